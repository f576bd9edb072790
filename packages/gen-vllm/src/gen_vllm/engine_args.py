"""From a ``VllmConfig`` to the keyword arguments of ``vllm.EngineArgs``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gen_vllm.config import VllmConfig

__all__ = ["engine_args_for", "resolve_dtype", "sleeps_on_finish", "wants_tokenizer"]

_GIB = 1 << 30
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def wants_tokenizer(config: VllmConfig) -> bool:
    """Whether to load the tokenizer (needed for stop strings only)."""
    setting = config["vllm_cfg"]["load_tokenizer"]
    if setting != "auto":
        return bool(setting)
    path = Path(config["model_name"])
    return not path.is_dir() or any((path / name).is_file() for name in _TOKENIZER_FILES)


def resolve_dtype(model: str, dtype: str) -> str:
    """``"auto"`` means the checkpoint's dtype, as in every backend of this project.

    vLLM's own "auto" turns float32 checkpoints into bfloat16 on CPU, which would make the same
    config give different numbers on different backends.
    """
    if dtype != "auto":
        return dtype
    config_file = Path(model) / "config.json"
    if config_file.is_file():
        saved = json.loads(config_file.read_text())
        found = saved.get("dtype") or saved.get("torch_dtype")
        if isinstance(found, str) and found in ("float32", "bfloat16", "float16"):
            return found
    return "auto"


def sleeps_on_finish(config: VllmConfig, *, use_gpus: bool) -> bool:
    """Whether ``finish_generation`` puts the engines to sleep (vLLM sleep mode, CUDA only).

    ``"auto"``: when colocated with a trainer on GPUs, which needs the memory back. Engines on
    GPUs of their own keep their weights and cache: sleeping would cost an offload and a reload
    every step for nothing.
    """
    setting = config["vllm_cfg"]["enable_sleep_mode"]
    if setting == "auto":
        return use_gpus and bool(config.get("colocated", {}).get("enabled", False))
    return bool(setting)


def engine_args_for(config: VllmConfig, *, use_gpus: bool) -> dict[str, Any]:
    """``vllm.EngineArgs`` keyword arguments (all but ``model`` and ``worker_extension_cls``)."""
    cfg = config["vllm_cfg"]
    args: dict[str, Any] = {
        "dtype": resolve_dtype(config["model_name"], config.get("dtype", "auto")),
        # Every sampled request carries its own 64-bit seed (params.py), so the engine's global
        # seed never decides a sample; vLLM seeds numpy with it, which takes 32 bits only.
        "seed": (config.get("seed") or 0) & 0xFFFFFFFF,
        "tensor_parallel_size": cfg["tensor_parallel_size"],
        "enforce_eager": cfg["enforce_eager"],
        "enable_prefix_caching": cfg["enable_prefix_caching"],
        "max_num_seqs": cfg["max_num_seqs"],
        "logprobs_mode": (
            "processed_logprobs" if config.get("logprobs_mode") == "processed" else "raw_logprobs"
        ),
        "skip_tokenizer_init": not wants_tokenizer(config),
        "enable_sleep_mode": sleeps_on_finish(config, use_gpus=use_gpus),
        # Weight updates go through vLLM's transaction with this project's engine (transfer.py).
        "weight_transfer_config": {"backend": "gen"},
    }
    if cfg["max_model_len"] is not None:
        args["max_model_len"] = cfg["max_model_len"]
    if use_gpus:
        args["gpu_memory_utilization"] = cfg["gpu_memory_utilization"]
        if cfg["tensor_parallel_size"] > 1:
            args["distributed_executor_backend"] = "ray"
    else:
        args["kv_cache_memory_bytes"] = int(cfg["cpu_kv_cache_gib"] * _GIB)
    args.update(cfg["engine_kwargs"])
    return args
