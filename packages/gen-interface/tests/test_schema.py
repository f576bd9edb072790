# Stringified annotations on purpose: check_config must resolve them in the declaring module.
from __future__ import annotations

import string
from typing import Any, Literal, NotRequired, Required, TypedDict

import pytest
from gen_interface import GenerationConfig, GenerationConfigError, configure_generation_config
from gen_interface.schema import check_config, declared_keys
from hypothesis import assume, given
from hypothesis import strategies as st

# --- a small schema tree: Root > settings > deep --------------------------------------------


class Deep(TypedDict, total=False):
    depth: Required[int]
    ratio: float
    tags: list[str]


class Settings(TypedDict, total=False):
    workers: int | None
    mode: Literal["fast", "slow"]
    flag: bool | Literal["auto"]
    extra: dict[str, Any]
    deep: Deep


class Base(TypedDict):
    name: str
    rate: NotRequired[float]
    verbose: NotRequired[bool]


class Root(Base, total=False):
    note: str | None
    settings: Settings


class BackendArgs(TypedDict, total=False):
    tensor_parallel_size: int
    max_model_len: int | None


class BackendConfig(GenerationConfig, total=False):
    """Shaped like ``VllmConfig``: inherits across modules and nests its own settings."""

    backend_cfg: BackendArgs


class Broken(TypedDict):
    x: Nope  # type: ignore[name-defined]  # noqa: F821


# Valid and wrong values per key, written out by hand so the test does not reuse the module's own
# reading of the annotations.
NUMBERS = st.integers() | st.floats()
ANYTHING = st.none() | st.booleans() | NUMBERS | st.text(max_size=4)
VALID: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "settings.deep": {
        "depth": st.integers(),
        "ratio": NUMBERS,
        "tags": st.lists(st.text(max_size=4), max_size=3),
    },
}
VALID["settings"] = {
    "workers": st.none() | st.integers(),
    "mode": st.sampled_from(["fast", "slow"]),
    "flag": st.booleans() | st.just("auto"),
    "extra": st.dictionaries(st.text(max_size=4), ANYTHING, max_size=3),
    "deep": st.fixed_dictionaries({}, optional=VALID["settings.deep"]),
}
VALID[""] = {
    "name": st.text(max_size=8),
    "rate": NUMBERS,
    "verbose": st.booleans(),
    "note": st.none() | st.text(max_size=8),
    "settings": st.fixed_dictionaries({}, optional=VALID["settings"]),
}
WRONG: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "": {
        "name": st.none() | st.integers() | st.lists(st.text(), max_size=2),
        "rate": st.booleans() | st.text() | st.none(),
        "verbose": st.integers() | st.sampled_from(["False", "true", "yes"]) | st.none(),
        "note": st.booleans() | NUMBERS,
        "settings": st.integers() | st.text() | st.lists(st.integers(), max_size=2),
    },
    "settings": {
        "workers": st.booleans() | st.floats() | st.text(),
        "mode": st.text().filter(lambda s: s not in ("fast", "slow")) | st.booleans(),
        "flag": st.text().filter(lambda s: s != "auto") | st.integers() | st.none(),
        "extra": st.lists(st.integers(), max_size=2) | st.text() | st.none(),
        "deep": st.integers() | st.text() | st.none(),
    },
    "settings.deep": {
        "depth": st.booleans() | st.floats() | st.text() | st.none(),
        "ratio": st.booleans() | st.text() | st.none(),
        "tags": st.text() | st.lists(st.integers() | st.none(), min_size=1, max_size=3),
    },
}
ALL_KEYS = {key for level in VALID.values() for key in level}


def join(parent: str, key: str) -> str:
    return f"{parent}.{key}" if parent else key


def level_of(config: dict[str, Any], level: str) -> dict[str, Any]:
    """The dict at ``level`` inside ``config``, created (empty, which is valid) when absent."""
    for part in filter(None, level.split(".")):
        config = config.setdefault(part, {})
    return config


def refusal(config: Any, schema: type = Root, **kwargs: Any) -> str:
    with pytest.raises(GenerationConfigError) as refused:
        check_config(config, schema, **kwargs)
    return str(refused.value)


valid_roots = st.fixed_dictionaries({}, optional=VALID[""])
declared = st.sampled_from([(level, key) for level in VALID for key in VALID[level]])


def test_the_hand_written_tables_cover_every_declared_key():
    assert set(VALID[""]) == set(declared_keys(Root))
    assert set(VALID["settings"]) == set(declared_keys(Settings))
    assert set(VALID["settings.deep"]) == set(declared_keys(Deep))


# --- properties -----------------------------------------------------------------------------


@given(config=valid_roots)
def test_every_config_of_declared_keys_with_valid_values_is_accepted(config):
    check_config(config, Root)
    check_config({**config, "loss_fn": object()}, Root, accepted_unread={"loss_fn"})


@given(config=valid_roots, target=declared, data=st.data())
def test_a_misspelt_key_is_refused_with_its_path_and_the_declared_key(config, target, data):
    level, key = target
    i = data.draw(st.integers(0, len(key) - 1), label="position")
    letter = data.draw(st.sampled_from(string.ascii_lowercase + "_"), label="letter")
    edit = data.draw(st.sampled_from(["drop", "insert", "swap"]), label="edit")
    if edit == "drop":
        typo = key[:i] + key[i + 1 :]
    elif edit == "insert":
        typo = key[:i] + letter + key[i:]
    else:
        assume(i + 1 < len(key))
        typo = key[:i] + key[i + 1] + key[i] + key[i + 2 :]
    assume(typo and typo not in ALL_KEYS)
    at = level_of(config, level)
    at.pop(key, None)
    at[typo] = data.draw(VALID[level][key], label="value")
    message = refusal(config)
    assert f"unknown key `{join(level, typo)}`" in message
    assert f"did you mean `{key}`" in message or f" or `{key}`" in message


# (from, key, to): one level down, then one level up
LEVEL_PAIRS = [
    ("", "settings"),
    ("settings", "settings.deep"),
    ("settings", ""),
    ("settings.deep", "settings"),
]
MOVES = [(src, key, dst) for src, dst in LEVEL_PAIRS for key in VALID[src] if key not in VALID[dst]]


@given(config=valid_roots, move=st.sampled_from(MOVES), data=st.data())
def test_a_key_moved_one_level_is_refused_naming_where_it_belongs(config, move, data):
    src, key, dst = move
    level_of(config, src).pop(key, None)
    level_of(config, dst)[key] = data.draw(VALID[src][key], label="value")
    message = refusal(config)
    assert f"unknown key `{join(dst, key)}`" in message
    where = f"in `{src}`" if src else "at the top level"
    assert f"`{key}` belongs {where} (`{join(src, key)}`)" in message


@given(config=valid_roots, target=declared, data=st.data())
def test_a_value_of_a_wrong_type_is_refused_naming_its_path(config, target, data):
    level, key = target
    level_of(config, level)[key] = data.draw(WRONG[level][key], label="wrong value")
    message = refusal(config)
    assert f"`{join(level, key)}" in message  # list items are named `key[i]`
    assert " must be " in message and " got " in message


# --- each message kind ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"nmae": "x"}, "unknown key `nmae`: did you mean `name`?"),
        ({"settings": {"wrokers": 2}}, "unknown key `settings.wrokers`: did you mean `workers`?"),
        ({"settings": {"deep": {"dept": 1}}}, "did you mean `depth`?"),
        (
            {"workers": 2},
            "unknown key `workers`: `workers` belongs in `settings` (`settings.workers`)",
        ),
        ({"depth": 2}, "`depth` belongs in `settings.deep` (`settings.deep.depth`)"),
        (
            {"settings": {"rate": 0.5}},
            "unknown key `settings.rate`: `rate` belongs at the top level (`rate`)",
        ),
        ({"wokers": 2}, "unknown key `wokers`: did you mean `settings.workers`?"),
        ({"settings": {"zzz": 1}}, "; `settings` takes `deep`, `extra`, `flag`, `mode`, `workers`"),
        ({"verbose": "False"}, "`verbose` must be a bool (true or false), got 'False' (str)"),
        ({"verbose": 1}, "`verbose` must be a bool (true or false), got 1 (int)"),
        ({"rate": True}, "`rate` must be a number, got True (bool)"),
        ({"settings": {"workers": True}}, "`settings.workers` must be an integer or null"),
        ({"settings": {"mode": "Fast"}}, "must be one of 'fast', 'slow', got 'Fast' (str)"),
        ({"settings": {"flag": "on"}}, "`settings.flag` must be a bool (true or false) or 'auto'"),
        ({"settings": {"deep": {"tags": ["a", 3]}}}, "`settings.deep.tags[1]` must be a string"),
        ({"settings": {"deep": {"tags": "a"}}}, "must be a list of strings, got 'a' (str)"),
        ({"settings": {"extra": {1: 2}}}, "`settings.extra` keys must be strings, got 1 (int)"),
        ({"settings": {"deep": 3}}, "`settings.deep` must be a dict (Deep), got 3 (int)"),
        ({"note": 3}, "`note` must be a string or null, got 3 (int)"),
    ],
)
def test_message(config, expected):
    assert expected in refusal(config)


def test_ints_are_numbers_and_anything_goes_under_dict_of_any():
    check_config({"rate": 1, "settings": {"extra": {"k": [object()]}, "flag": "auto"}}, Root)


def test_a_config_that_is_not_a_mapping_is_refused():
    assert refusal(["name"]) == "the config must be a dict (Root), got ['name'] (list)"


def test_accepted_unread_is_top_level_only_and_declared_keys_are_still_checked():
    check_config({"loss": "x"}, Root, accepted_unread=["loss"])
    assert "unknown key `settings.loss`" in refusal(
        {"settings": {"loss": 1}}, accepted_unread=["loss"]
    )
    assert "`rate` must be a number" in refusal({"rate": "x"}, accepted_unread=["rate"])


def test_path_prefixes_every_name():
    message = refusal({"settings": {"rate": 1.0}}, path="policy.gen")
    assert message == (
        "unknown key `policy.gen.settings.rate`: `rate` belongs in `policy.gen` (`policy.gen.rate`)"
    )


def test_declared_keys_include_inherited_keys_without_required_wrappers():
    keys = declared_keys(Root)
    assert keys["rate"] is float and keys["settings"] is Settings and keys["name"] is str
    assert declared_keys(Deep)["depth"] is int
    keys["extra"] = int  # a copy: the cached table is not changed
    assert "extra" not in declared_keys(Root)


def test_schemas_that_cannot_be_read_raise_type_error():
    with pytest.raises(TypeError, match="not a TypedDict"):
        check_config({}, dict)
    with pytest.raises(TypeError, match="cannot resolve the annotations of Broken"):
        check_config({"x": 1}, Broken)


# --- the real GenerationConfig and a backend extension of it ---------------------------------


class Tok:
    pad_token_id, eos_token_id = 0, 2


def test_a_configured_generation_config_passes():
    config = configure_generation_config({"backend": "hf", "model_name": "m"}, Tok())
    check_config(config, GenerationConfig)
    check_config({**config, "backend_cfg": {"max_model_len": None}}, BackendConfig)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"temprature": 1.0}, "unknown key `temprature`: did you mean `temperature`?"),
        ({"top_k": True}, "`top_k` must be an integer or null, got True (bool)"),
        ({"logprobs_mode": "rw"}, "`logprobs_mode` must be one of 'raw', 'processed'"),
        ({"stop_token_ids": [1, "2"]}, "`stop_token_ids[1]` must be an integer, got '2' (str)"),
        ({"colocated": {"enabled": "yes"}}, "`colocated.enabled` must be a bool (true or false)"),
        ({"enabled": True}, "`enabled` belongs in `colocated` (`colocated.enabled`)"),
        (
            {"backend_cfg": {"max_model_length": 8}},
            "unknown key `backend_cfg.max_model_length`: did you mean `max_model_len`?",
        ),
        (
            {"tensor_parallel_size": 2},
            "`tensor_parallel_size` belongs in `backend_cfg` (`backend_cfg.tensor_parallel_size`)",
        ),
        ({"backend_cfg": {"temperature": 0.5}}, "`temperature` belongs at the top level"),
        ({"backend_cfg": {"tensor_parallel_size": "2"}}, "must be an integer, got '2' (str)"),
    ],
)
def test_generation_config_message(config, expected):
    assert expected in refusal(config, BackendConfig)
