"""``HfConfig``: ``GenerationConfig`` plus ``hf_cfg``, the settings of the transformers backend."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict, cast

from gen_backend_kit.settings import check_int_setting, complete_backend_settings
from gen_backend_kit.speculation import refuse_unoffered_speculation
from gen_interface import GenerationConfig, GenerationConfigError

__all__ = [
    "HF_CFG_DEFAULTS",
    "AttnImplementation",
    "HfConfig",
    "HfSpecificArgs",
    "complete_hf_config",
]

AttnImplementation = Literal["sdpa", "eager"]

_ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("sdpa", "eager")


class HfSpecificArgs(TypedDict, total=False):
    """Backend settings under ``HfConfig["hf_cfg"]``; every key has a default."""

    device: str  # "auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N" ("auto")
    attn_implementation: AttnImplementation  # transformers attention kernel ("eager")
    max_batch_size: int  # most rows per forward pass; larger batches run in chunks (64)
    max_model_len: int | None  # longest prompt + generation; None = the model's limit (None)
    load_format: Literal["auto", "dummy"]  # "dummy": build from config.json, weights by update
    load_tokenizer: bool | Literal["auto"]  # tokenizer for stop strings ("auto": if it loads)
    trust_remote_code: bool  # passed to from_pretrained (False)
    model_kwargs: dict[str, Any]  # anything else for from_pretrained, as is ({})


#: Defaults for every ``hf_cfg`` key.
HF_CFG_DEFAULTS: HfSpecificArgs = {
    "device": "auto",
    "attn_implementation": "eager",
    "max_batch_size": 64,
    "max_model_len": None,
    "load_format": "auto",
    "load_tokenizer": "auto",
    "trust_remote_code": False,
    "model_kwargs": {},
}

# from_pretrained arguments the backend sets itself from the fields above.
_RESERVED_MODEL_KWARGS = ("dtype", "torch_dtype", "attn_implementation", "trust_remote_code")


class HfConfig(GenerationConfig, total=False):
    """``GenerationConfig`` plus the transformers backend's settings (see ``HfSpecificArgs``)."""

    hf_cfg: HfSpecificArgs


def complete_hf_config(config: Mapping[str, Any]) -> HfConfig:
    """A copy of ``config`` with every ``hf_cfg`` default filled in, validated.

    The generation keys must already be complete (``configure_generation_config``); the argument
    is not changed.

    Args:
        config: an ``HfConfig`` (``hf_cfg`` may be absent or partial).

    Returns:
        A new ``HfConfig`` whose ``hf_cfg`` holds every key of ``HF_CFG_DEFAULTS``.

    Raises:
        GenerationConfigError: a field is missing or out of range; ``hf_cfg`` fields are named
            ``hf_cfg.<key>``.
    """
    out, cfg = complete_backend_settings(config, "hf_cfg", HF_CFG_DEFAULTS, schema=HfConfig)
    _check_device(cfg["device"])
    if cfg["attn_implementation"] not in _ATTN_IMPLEMENTATIONS:
        raise GenerationConfigError(
            f"hf_cfg.attn_implementation must be one of {_ATTN_IMPLEMENTATIONS}, "
            f"got {cfg['attn_implementation']!r}"
        )
    check_int_setting(cfg, "hf_cfg", "max_batch_size")
    if cfg["max_model_len"] is not None:
        check_int_setting(cfg, "hf_cfg", "max_model_len", minimum=2)
    if cfg["load_tokenizer"] not in (True, False, "auto"):
        raise GenerationConfigError(
            f"hf_cfg.load_tokenizer must be true, false or 'auto', got {cfg['load_tokenizer']!r}"
        )
    if not isinstance(cfg["trust_remote_code"], bool):
        raise GenerationConfigError(
            f"hf_cfg.trust_remote_code must be a bool, got {cfg['trust_remote_code']!r}"
        )
    kwargs = cfg["model_kwargs"]
    if not isinstance(kwargs, Mapping):
        raise GenerationConfigError(
            f"hf_cfg.model_kwargs must be a dict, got {type(kwargs).__name__}"
        )
    reserved = sorted(set(kwargs) & set(_RESERVED_MODEL_KWARGS))
    if reserved:
        raise GenerationConfigError(
            f"hf_cfg.model_kwargs must not set {reserved}: use the config's dtype and "
            "hf_cfg.attn_implementation / hf_cfg.trust_remote_code instead"
        )
    if out.get("batch_invariant") and out.get("lm_head_fp32"):
        raise GenerationConfigError(
            "batch_invariant and lm_head_fp32 are both true: batch-invariant logprobs equal the "
            "trainer's exact forward (gen_hf.exact.sequence_logprobs), which runs the head in "
            "the model's dtype; set one of them to false"
        )
    # transformers' assisted decoding (assistant_model) has no per-row seeds, per-token weight
    # versions or verified refit of the assistant; it stays out until it meets the contract
    refuse_unoffered_speculation(out, "HfGeneration", frozenset())
    if out.get("batch_invariant") and out.get("lora"):
        raise GenerationConfigError(
            "batch_invariant and lora are both set: the adapter's low-rank product runs outside "
            "the batch-invariant kernels; set one of them off"
        )
    out["hf_cfg"] = cfg
    return cast(HfConfig, out)


def _check_device(device: Any) -> None:
    ok = isinstance(device, str) and (
        device in ("auto", "cpu", "cuda")
        or (device.startswith("cuda:") and device.removeprefix("cuda:").isdigit())
    )
    if not ok:
        raise GenerationConfigError(
            f"hf_cfg.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}"
        )
