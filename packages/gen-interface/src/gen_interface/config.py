"""Config defaults and validation of ``GenerationConfig``."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, get_args

from gen_interface.errors import BackendUnavailableError, GenerationConfigError
from gen_interface.nemo_rl_keys import with_nemo_rl_keys
from gen_interface.schema import ForeignKeys, check_config
from gen_interface.seeds import MAX_SEED
from gen_interface.specs import (
    DraftSampleMethod,
    GenerationConfig,
    SpeculativeConfig,
    SpeculativeMethod,
)

if TYPE_CHECKING:
    from gen_interface.interface import GenerationInterface

__all__ = [
    "GENERATION_CONFIG_DEFAULTS",
    "PER_CALL_SETTINGS",
    "TokenizerLike",
    "configure_generation_config",
    "sampling_settings_of",
    "validate_generation_config",
    "with_per_call_overrides",
]

ConfigT = TypeVar("ConfigT", bound=Mapping[str, Any])

#: Values ``configure_generation_config`` fills in for keys the caller left out.
#: ``pad_token_id`` and ``stop_token_ids`` come from the tokenizer instead.
GENERATION_CONFIG_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 64,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": None,
    "min_p": 0.0,
    "stop_strings": None,
    "logprobs_mode": "raw",
    "top_logprobs": 0,
    "seed": None,
    "dtype": "auto",
    "colocated": {"enabled": False},
    "max_weight_staleness": None,
    "batch_invariant": False,
    "lm_head_fp32": False,
    "return_routed_experts": False,
    "lora": None,
    "speculative": None,
}

#: Settings a backend can change between calls without reloading anything (vLLM takes them per
#: request); ``with_sampling`` front ends may override these and nothing else.
PER_CALL_SETTINGS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop_token_ids",
        "stop_strings",
        "seed",
        "top_logprobs",
        "max_weight_staleness",
    }
)

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOGPROBS_MODES = ("raw", "processed")


class TokenizerLike(Protocol):
    """What ``configure_generation_config`` reads from a tokenizer (any HF tokenizer fits)."""

    pad_token_id: int | None
    eos_token_id: int | None


def configure_generation_config(
    config: ConfigT, tokenizer: TokenizerLike | None, *, is_eval: bool | None = None
) -> ConfigT:
    """Return a new, complete, validated copy of ``config``; the argument is not changed.

    Fills defaults (``GENERATION_CONFIG_DEFAULTS``), ``pad_token_id`` from the tokenizer (its pad
    token, else its eos token) and ``stop_token_ids`` = ``[eos_token_id]`` when None or absent.
    Keys the caller set are kept. Every key at every level must be declared by the backend's
    ``config_schema`` (or be one of NeMo RL's keys with an inert value: ``nemo_rl_keys``).

    Args:
        config: a ``GenerationConfig`` or a backend's extension of it.
        tokenizer: anything with ``pad_token_id`` and ``eos_token_id``; None when the config
            already names ``pad_token_id`` and ``stop_token_ids``.
        is_eval: NeMo RL's switch, applied by the backend's ``set_weight_loading``. None (the
            default): left as configured, which loads the checkpoint. True: load the
            checkpoint. False, for a training run: start without reading the checkpoint, since
            the first weight update brings the weights; ``generate`` refuses until that update
            commits. NeMo RL's default is False.

    Raises:
        GenerationConfigError: a key is unknown or misplaced, or a field is missing, of the wrong
            type or out of range; the message names its dotted path.
    """
    out: dict[str, Any] = copy.deepcopy(dict(config))
    for key, value in GENERATION_CONFIG_DEFAULTS.items():
        out.setdefault(key, copy.deepcopy(value))
    eos = getattr(tokenizer, "eos_token_id", None)
    if out.get("pad_token_id") is None:
        pad = getattr(tokenizer, "pad_token_id", None)
        out["pad_token_id"] = pad if pad is not None else eos
    if out.get("stop_token_ids") is None:
        out["stop_token_ids"] = [eos] if eos is not None else []
    if is_eval is not None:
        _set_weight_loading(out, is_eval)
    validate_generation_config(out)
    return cast(ConfigT, out)


def validate_generation_config(
    config: Mapping[str, Any], *, schema: type | None = None, foreign: ForeignKeys | None = None
) -> None:
    """Check that ``config`` is complete, every key is known and every field is in range.

    Backends call this in their constructor so a config that skipped
    ``configure_generation_config`` fails there, not in the middle of a generate call.

    Args:
        config: the config to check.
        schema: the TypedDict declaring its keys; default: the ``config_schema`` of the installed
            backend named by ``config["backend"]`` (``GenerationConfig`` if none is).
        foreign: undeclared keys accepted at levels below the top (the backend's
            ``config_foreign_keys`` by default); NeMo RL's own are always added.

    Raises:
        GenerationConfigError: naming the first field that is unknown, missing, of the wrong type
            or out of range.
    """
    if schema is None:
        backend = _installed_backend(config.get("backend"))
        schema = backend.config_schema if backend is not None else GenerationConfig
        foreign = backend.config_foreign_keys if backend is not None else foreign
    check_config(config, schema, foreign=with_nemo_rl_keys(foreign or {}))
    for key in ("backend", "model_name"):
        value = config.get(key)
        if not isinstance(value, str) or not value:
            raise GenerationConfigError(f"{key} must be a non-empty string, got {value!r}")
    _int_field(config, "max_new_tokens", minimum=1)
    temperature = _number_field(config, "temperature")
    if temperature < 0:
        raise GenerationConfigError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    top_p = _number_field(config, "top_p")
    if not 0 < top_p <= 1:
        raise GenerationConfigError(f"top_p must be in (0, 1], got {top_p}")
    top_k = config.get("top_k")
    if top_k is not None and top_k != -1:
        _int_field(config, "top_k", minimum=1, hint="None or -1 = off")
    min_p = _number_field(config, "min_p") if "min_p" in config else 0.0
    if not 0 <= min_p <= 1:
        raise GenerationConfigError(f"min_p must be in [0, 1] (0 = off), got {min_p}")
    if "top_logprobs" in config:
        _int_field(config, "top_logprobs", minimum=0, hint="0 = off")
    pad = config.get("pad_token_id")
    if pad is None:
        raise GenerationConfigError(
            "pad_token_id is missing: call configure_generation_config(config, tokenizer) or set it"
        )
    _int_field(config, "pad_token_id", minimum=0)
    _id_list_field(config, "stop_token_ids")
    stop_strings = config.get("stop_strings")
    if stop_strings is not None and (
        not isinstance(stop_strings, list)
        or not all(isinstance(s, str) and s for s in stop_strings)
    ):
        raise GenerationConfigError(
            f"stop_strings must be None or a list of non-empty strings, got {stop_strings!r}"
        )
    if config.get("logprobs_mode", "raw") not in _LOGPROBS_MODES:
        raise GenerationConfigError(
            f"logprobs_mode must be one of {_LOGPROBS_MODES}, got {config.get('logprobs_mode')!r}"
        )
    seed = config.get("seed")
    if seed is not None:
        _int_field(config, "seed", minimum=0, maximum=MAX_SEED, hint="None = fresh randomness")
    if config.get("dtype", "auto") not in _DTYPES:
        raise GenerationConfigError(f"dtype must be one of {_DTYPES}, got {config.get('dtype')!r}")
    if config.get("max_weight_staleness") is not None:
        _int_field(config, "max_weight_staleness", minimum=0, hint="None = no bound")
    colocated = config.get("colocated", {"enabled": False})
    if not isinstance(colocated, Mapping) or not isinstance(colocated.get("enabled"), bool):
        raise GenerationConfigError(
            f"colocated must be a dict with a bool 'enabled', got {colocated!r}"
        )
    if config.get("lora") is not None:
        _check_lora(config["lora"])
    if config.get("speculative") is not None:
        _check_speculative(config["speculative"])


def _check_lora(lora: Any) -> None:
    """A ``lora`` section names a PEFT adapter directory, or gives rank, alpha and targets."""
    if not isinstance(lora, Mapping):
        raise GenerationConfigError(f"lora must be None or a dict, got {lora!r}")
    path = lora.get("adapter_path")
    if path is not None:
        if not (Path(path) / "adapter_config.json").is_file():
            raise GenerationConfigError(
                f"lora.adapter_path {path!r} is not a PEFT adapter directory (no "
                "adapter_config.json there)"
            )
        return
    rank, alpha, targets = lora.get("rank"), lora.get("alpha"), lora.get("target_modules")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise GenerationConfigError(f"lora.rank must be an integer >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise GenerationConfigError(f"lora.alpha must be a number > 0, got {alpha!r}")
    if (
        not isinstance(targets, list)
        or not targets
        or not all(isinstance(t, str) and t for t in targets)
    ):
        raise GenerationConfigError(
            f"lora.target_modules must be a non-empty list of layer names (e.g. ['q_proj', "
            f"'v_proj']), got {targets!r}; or give lora.adapter_path"
        )


_SPECULATIVE_METHODS = get_args(SpeculativeMethod)
_SPECULATIVE_KEYS = frozenset(SpeculativeConfig.__annotations__)


def _check_speculative(section: Any) -> None:
    """A ``speculative`` section names a method, the tokens per step, and what the method needs:
    a drafter ``model`` for draft_model, a lookup window for ngram."""
    if not isinstance(section, Mapping):
        raise GenerationConfigError(f"speculative must be None or a dict, got {section!r}")
    unknown = sorted(set(section) - _SPECULATIVE_KEYS)
    if unknown:
        raise GenerationConfigError(
            f"unknown key(s) {unknown} in speculative; its keys are {sorted(_SPECULATIVE_KEYS)}"
        )
    method = section.get("method")
    if method not in _SPECULATIVE_METHODS:
        raise GenerationConfigError(
            f"speculative.method must be one of {list(_SPECULATIVE_METHODS)}, got {method!r}"
        )
    tokens = section.get("num_speculative_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise GenerationConfigError(
            f"speculative.num_speculative_tokens must be an integer >= 1 (tokens proposed per "
            f"step), got {tokens!r}"
        )
    drafting = section.get("draft_sample_method", "greedy")
    if drafting not in get_args(DraftSampleMethod):
        raise GenerationConfigError(
            f"speculative.draft_sample_method must be one of {list(get_args(DraftSampleMethod))}"
            f", got {drafting!r}"
        )
    _check_batch_schedule(section.get("num_speculative_tokens_per_batch_size"), tokens)
    floor = section.get("min_acceptance_rate", 0.0)
    if isinstance(floor, bool) or not isinstance(floor, int | float) or not 0 <= floor <= 1:
        raise GenerationConfigError(
            f"speculative.min_acceptance_rate must be a number in [0, 1] (0: never warn), "
            f"got {floor!r}"
        )
    model = section.get("model")
    if method == "draft_model" and not (isinstance(model, str) and model):
        raise GenerationConfigError(
            "speculative.method 'draft_model' needs speculative.model: the drafter's model "
            "directory (a smaller model with the target's vocabulary)"
        )
    if method == "ngram":
        low = section.get("prompt_lookup_min", 1)
        high = section.get("prompt_lookup_max", max(low, 1) if isinstance(low, int) else 1)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)) or not (
            1 <= low <= high
        ):
            raise GenerationConfigError(
                "speculative.prompt_lookup_min and prompt_lookup_max must be integers with "
                f"1 <= min <= max, got {low!r} and {high!r}"
            )


def _check_batch_schedule(schedule: Any, tokens: int) -> None:
    """``speculative.num_speculative_tokens_per_batch_size``: None, or sorted inclusive ranges
    ``(first, last, k)`` of batch size that start at 1, overlap nowhere and propose
    ``0 <= k <= tokens`` drafts."""
    if schedule is None:
        return
    what = (
        "speculative.num_speculative_tokens_per_batch_size must be a list of (first, last, k): "
        "inclusive batch-size ranges, sorted, the first starting at 1, none overlapping, each "
        f"with 0 <= k <= num_speculative_tokens ({tokens}); e.g. [[1, 8, {tokens}], [9, 1024, 0]]"
    )
    if not isinstance(schedule, list | tuple) or not schedule:
        raise GenerationConfigError(f"{what}; got {schedule!r}")
    end = 0
    for entry in schedule:
        if (
            not isinstance(entry, list | tuple)
            or len(entry) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
        ):
            raise GenerationConfigError(f"{what}; entry {entry!r} is not three integers")
        first, last, k = entry
        if (end == 0 and first != 1) or first <= end:
            raise GenerationConfigError(f"{what}; entry {list(entry)} starts at {first}")
        if last < first or not 0 <= k <= tokens:
            raise GenerationConfigError(f"{what}; got entry {list(entry)}")
        end = last


def with_per_call_overrides(config: ConfigT, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with ``overrides`` applied, validated; only ``PER_CALL_SETTINGS`` may change.

    Raises:
        GenerationConfigError: an override names another setting, or is out of range.
    """
    other = sorted(set(overrides) - PER_CALL_SETTINGS)
    if other:
        raise GenerationConfigError(
            f"cannot change {other} per call: they are engine settings; per-call settings are "
            f"{sorted(PER_CALL_SETTINGS)}"
        )
    out = {**copy.deepcopy(dict(config)), **overrides}
    validate_generation_config(out)
    return out


def sampling_settings_of(config: GenerationConfig) -> tuple[float, int | None, float]:
    """``(temperature, top_k or None, top_p)`` with "off" values normalised (top_k -1 -> None)."""
    top_k = config.get("top_k")
    return (
        float(config.get("temperature", 1.0)),
        None if top_k in (None, -1) else int(cast(int, top_k)),
        float(config.get("top_p", 1.0)),
    )


def _int_field(
    config: Mapping[str, Any],
    key: str,
    *,
    minimum: int,
    maximum: int | None = None,
    hint: str = "",
) -> int:
    value = config.get(key)
    extra = f" ({hint})" if hint else ""
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise GenerationConfigError(f"{key} must be an integer {bound}{extra}, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        raise GenerationConfigError(f"{key} must be {bound}{extra}, got {value}")
    return value


def _number_field(config: Mapping[str, Any], key: str) -> float:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise GenerationConfigError(f"{key} must be a finite number, got {value!r}")
    return float(value)


def _id_list_field(config: Mapping[str, Any], key: str) -> None:
    value = config.get(key)
    if value is None:
        return
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise GenerationConfigError(
            f"{key} must be None or a list of token ids (integers >= 0), got {value!r}"
        )


def _installed_backend(name: object) -> type[GenerationInterface] | None:
    """The backend class called ``name``, or None when none is installed under that name."""
    from gen_interface.registry import available_backends, load_backend

    if not isinstance(name, str) or name not in available_backends():
        return None
    try:
        return load_backend(name)
    except BackendUnavailableError:
        return None


def _set_weight_loading(config: dict[str, Any], is_eval: bool) -> None:
    backend = _installed_backend(config.get("backend"))
    if backend is not None:
        backend.set_weight_loading(config, read_checkpoint=is_eval)
    elif not is_eval:
        raise GenerationConfigError(
            f"backend {config.get('backend')!r} cannot be set to start without its weights "
            "(is_eval=False): no backend of that name is installed in this environment; leave "
            "is_eval out"
        )
