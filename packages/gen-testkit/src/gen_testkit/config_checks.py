"""Hypothesis strategies for the config-schema properties every backend must show.

A backend's test module gives its valid values per key (``ValidValues``: level -> key ->
strategy) and how a config is completed (``configure_generation_config`` and the backend's own
completion). The properties: a config holding any declared key with a valid value is accepted;
the same config with one key misspelt (a letter dropped, inserted or two swapped) or moved one
level up or down is refused, naming the key's dotted path.
"""

from __future__ import annotations

import copy
import string
from collections.abc import Mapping
from typing import Any

from gen_interface.schema import ForeignKeys, declared_keys
from hypothesis import strategies as st
from typing_extensions import is_typeddict

__all__ = [
    "ConfigSchemaChecks",
    "ValidValues",
    "declared_levels",
    "for_backend",
    "generation_valid_values",
    "misspelling",
    "nested_level",
    "with_key",
]

#: level (dotted path, "" for the top) -> key -> strategy of valid values.
ValidValues = Mapping[str, Mapping[str, st.SearchStrategy[Any]]]


def declared_levels(schema: type) -> dict[str, set[str]]:
    """Every level of ``schema`` that is a TypedDict -> the keys it declares."""
    levels: dict[str, set[str]] = {}

    def walk(tp: type, path: str) -> None:
        fields = declared_keys(tp)
        levels[path] = set(fields)
        for key, sub in fields.items():
            if is_typeddict(sub):
                walk(sub, f"{path}.{key}" if path else key)

    walk(schema, "")
    return levels


def nested_level(config: dict[str, Any], level: str) -> dict[str, Any]:
    """The dict at ``level`` inside ``config``, created empty when absent."""
    for part in filter(None, level.split(".")):
        config = config.setdefault(part, {})
    return config


def with_key(base: Mapping[str, Any], level: str, key: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``base`` with ``level.key`` set to ``value``."""
    config = copy.deepcopy(dict(base))
    nested_level(config, level)[key] = value
    return config


@st.composite
def misspelling(draw: st.DrawFn, key: str) -> str:
    """``key`` with one letter dropped, one inserted, or two adjacent letters swapped."""
    kind = draw(st.sampled_from(["drop", "insert", "swap"] if len(key) > 1 else ["insert"]))
    if kind == "drop":
        i = draw(st.integers(0, len(key) - 1))
        return key[:i] + key[i + 1 :]
    if kind == "insert":
        i = draw(st.integers(0, len(key)))
        return key[:i] + draw(st.sampled_from(string.ascii_lowercase + "_")) + key[i:]
    i = draw(st.integers(0, len(key) - 2))
    return key[:i] + key[i + 1] + key[i] + key[i + 2 :]


class ConfigSchemaChecks:
    """Property tests of a backend's config checking; subclass it in the backend's tests.

    Subclasses set ``schema`` (the backend's config TypedDict), ``base`` (a minimal valid
    config before completion), ``valid`` (valid values for every declared key) and ``complete``
    (configure and complete a config as the backend's constructor would, without loading
    anything).
    """

    schema: type
    foreign: ForeignKeys = {}
    base: Mapping[str, Any]
    valid: ValidValues

    def complete(self, config: dict[str, Any]) -> Any:
        raise NotImplementedError

    def undeclared(self, level: str) -> set[str]:
        """Keys accepted at ``level`` without being declared (NeMo RL's, while off)."""
        from gen_interface.nemo_rl_keys import NEMO_RL_KEYS

        return set(NEMO_RL_KEYS.get(level, {})) | set(self.foreign.get(level, {}))

    def refusal(self, config: dict[str, Any]) -> str:
        from gen_interface import GenerationConfigError

        try:
            self.complete(config)
        except GenerationConfigError as exc:
            return str(exc)
        raise AssertionError(f"accepted: {config}")

    def declared(self) -> list[tuple[str, str]]:
        return sorted((lv, k) for lv, keys in declared_levels(self.schema).items() for k in keys)

    def test_the_valid_values_cover_every_declared_key(self) -> None:
        assert {lv: set(keys) for lv, keys in self.valid.items()} == declared_levels(self.schema)

    def test_every_declared_key_with_a_valid_value_is_accepted(self) -> None:
        from hypothesis import given

        @given(data=st.data(), where=st.sampled_from(self.declared()))
        def check(data: st.DataObject, where: tuple[str, str]) -> None:
            level, key = where
            value = data.draw(self.valid[level][key], label=f"{level}.{key}")
            self.complete(with_key(self.base, level, key, value))

        check()

    def test_a_misspelt_key_is_refused_naming_its_path(self) -> None:
        from hypothesis import assume, given

        levels = declared_levels(self.schema)

        @given(data=st.data(), where=st.sampled_from(self.declared()))
        def check(data: st.DataObject, where: tuple[str, str]) -> None:
            level, key = where
            wrong = data.draw(misspelling(key), label="misspelt")
            assume(wrong not in levels[level] and wrong not in self.undeclared(level))
            value = data.draw(self.valid[level][key], label="value")
            path = f"{level}.{wrong}" if level else wrong
            assert f"`{path}`" in self.refusal(with_key(self.base, level, wrong, value))

        check()

    def test_a_key_moved_one_level_is_refused_naming_its_path(self) -> None:
        from hypothesis import assume, given

        levels = declared_levels(self.schema)
        moves = [
            (src, dst, key)
            for src, keys in levels.items()
            for dst in levels
            if _parent(src) == dst or _parent(dst) == src
            for key in keys
            if src != dst
        ]

        @given(data=st.data(), move=st.sampled_from(sorted(moves)))
        def check(data: st.DataObject, move: tuple[str, str, str]) -> None:
            src, dst, key = move
            assume(key not in levels[dst] and key not in self.undeclared(dst))
            value = data.draw(self.valid[src][key], label="value")
            path = f"{dst}.{key}" if dst else key
            assert f"`{path}`" in self.refusal(with_key(self.base, dst, key, value))

        check()


def _parent(level: str) -> str | None:
    return None if not level else level.rpartition(".")[0]


def generation_valid_values(backend: str) -> dict[str, dict[str, st.SearchStrategy[Any]]]:
    """Valid values of every ``GenerationConfig`` key, for ``ConfigSchemaChecks.valid``."""
    token = st.integers(0, 10**6)
    return {
        "": {
            "backend": st.just(backend),
            "model_name": st.text(string.ascii_letters + "/-_.", min_size=1, max_size=12),
            "max_new_tokens": st.integers(1, 10**6),
            "temperature": st.floats(0.0, 10.0),
            "top_p": st.floats(0.01, 1.0),
            "top_k": st.none() | st.just(-1) | st.integers(1, 10**6),
            "min_p": st.floats(0.0, 1.0),
            "top_logprobs": st.integers(0, 20),
            "stop_token_ids": st.none() | st.lists(token, max_size=3),
            "stop_strings": st.none(),  # a tokenizer is checked for by the backend, not here
            "pad_token_id": token,
            "logprobs_mode": st.sampled_from(["raw", "processed"]),
            "seed": st.none() | st.integers(0, 2**64 - 1),
            "dtype": st.sampled_from(["auto", "float32", "bfloat16", "float16"]),
            "colocated": st.fixed_dictionaries({"enabled": st.booleans()}),
            "max_weight_staleness": st.none() | st.integers(0, 10**6),
            "batch_invariant": st.booleans(),
            "lm_head_fp32": st.booleans(),
            "return_routed_experts": st.booleans(),
            "lora": st.none(),  # a section is checked against the model, by the backend
            "speculative": st.none(),  # a drafter is checked against the model, by the backend
        },
        "colocated": {"enabled": st.booleans()},
    }


def for_backend(config: Mapping[str, Any], backend: str) -> dict[str, Any]:
    """``config``'s shared ``GenerationConfig`` keys, for another backend: the same generation
    settings, without the first backend's own levels (``vllm_cfg``, ``vllm_kwargs``, ...)."""
    from gen_interface import GenerationConfig

    shared = declared_keys(GenerationConfig)
    return {**{k: copy.deepcopy(v) for k, v in config.items() if k in shared}, "backend": backend}
