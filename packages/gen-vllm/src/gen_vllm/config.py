"""``VllmConfig``: ``GenerationConfig`` plus ``vllm_cfg``, the engine's own settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict, cast

from gen_interface import GenerationConfig, GenerationConfigError
from gen_interface.config import check_int_setting, complete_backend_settings

__all__ = ["VLLM_CFG_DEFAULTS", "VllmConfig", "VllmSpecificArgs", "complete_vllm_config"]


class VllmSpecificArgs(TypedDict, total=False):
    """Engine settings under ``VllmConfig["vllm_cfg"]``; every key has a default."""

    tensor_parallel_size: int  # GPUs per engine (1). Data-parallel replicas = bundles / this.
    gpu_memory_utilization: float  # CUDA: fraction of each GPU for weights + KV cache (0.8)
    max_model_len: int | None  # longest prompt + generation; None = the model's limit
    cpu_kv_cache_gib: float  # CPU: KV-cache size per engine in GiB (1.0)
    enforce_eager: bool  # no CUDA graphs / torch.compile (True: fast start, needed on CPU)
    enable_prefix_caching: bool  # reuse KV of shared prompt prefixes across calls (True)
    max_num_seqs: int  # most sequences an engine runs at once (256)
    load_tokenizer: bool | Literal["auto"]  # tokenizer for stop strings ("auto": if present)
    enable_sleep_mode: bool | Literal["auto"]  # sleep in finish ("auto": colocated on CUDA)
    engine_kwargs: dict[str, Any]  # anything else, passed to vllm.EngineArgs as is ({})
    startup_timeout_s: float  # how long an engine may take to start (900)
    generate_timeout_s: float  # how long one generate or score call may take (3600)
    update_timeout_s: float  # how long a weight update may take (900)
    control_timeout_s: float  # how long sleep, wake-up or a cache reset may take (300)


#: Defaults for every ``vllm_cfg`` key.
VLLM_CFG_DEFAULTS: VllmSpecificArgs = {
    "tensor_parallel_size": 1,
    "gpu_memory_utilization": 0.8,
    "max_model_len": None,
    "cpu_kv_cache_gib": 1.0,
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "max_num_seqs": 256,
    "load_tokenizer": "auto",
    "enable_sleep_mode": "auto",
    "engine_kwargs": {},
    "startup_timeout_s": 900.0,
    "generate_timeout_s": 3600.0,
    "update_timeout_s": 900.0,
    "control_timeout_s": 300.0,
}


class VllmConfig(GenerationConfig, total=False):
    """``GenerationConfig`` plus the vLLM engine settings (see ``VllmSpecificArgs``)."""

    vllm_cfg: VllmSpecificArgs


def complete_vllm_config(config: Mapping[str, Any]) -> VllmConfig:
    """A copy of ``config`` with every ``vllm_cfg`` default filled in, validated.

    The generation keys must already be complete (``configure_generation_config``).

    Raises:
        GenerationConfigError: a field is missing or out of range; ``vllm_cfg`` fields are named
            ``vllm_cfg.<key>``.
    """
    out, cfg = complete_backend_settings(
        config,
        "vllm_cfg",
        VLLM_CFG_DEFAULTS,
        hint="pass other engine arguments in vllm_cfg.engine_kwargs",
    )
    check_int_setting(cfg, "vllm_cfg", "tensor_parallel_size")
    check_int_setting(cfg, "vllm_cfg", "max_num_seqs")
    if cfg["max_model_len"] is not None:
        check_int_setting(cfg, "vllm_cfg", "max_model_len")
    _fraction(cfg, "gpu_memory_utilization")
    _positive_number(cfg, "cpu_kv_cache_gib")
    for key in ("startup_timeout_s", "generate_timeout_s", "update_timeout_s", "control_timeout_s"):
        _positive_number(cfg, key)
    for key in ("enforce_eager", "enable_prefix_caching"):
        if not isinstance(cfg[key], bool):
            raise GenerationConfigError(f"vllm_cfg.{key} must be a bool, got {cfg[key]!r}")
    for key in ("load_tokenizer", "enable_sleep_mode"):
        if cfg[key] not in (True, False, "auto"):
            raise GenerationConfigError(
                f"vllm_cfg.{key} must be true, false or 'auto', got {cfg[key]!r}"
            )
    if not isinstance(cfg["engine_kwargs"], Mapping):
        raise GenerationConfigError("vllm_cfg.engine_kwargs must be a dict")
    out["vllm_cfg"] = cfg
    return cast(VllmConfig, out)


def _positive_number(cfg: Mapping[str, Any], key: str) -> None:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise GenerationConfigError(f"vllm_cfg.{key} must be a number > 0, got {value!r}")


def _fraction(cfg: Mapping[str, Any], key: str) -> None:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise GenerationConfigError(f"vllm_cfg.{key} must be in (0, 1], got {value!r}")
