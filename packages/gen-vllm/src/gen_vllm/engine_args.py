"""From a ``VllmConfig`` to the keyword arguments of ``vllm.EngineArgs``."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gen_backend_kit.lora import lora_settings
from gen_backend_kit.settings import resolve_dtype
from gen_interface import GenerationConfigError

from gen_vllm.adapter import lora_engine_args
from gen_vllm.config import VLLM_CFG_DEFAULTS, VllmConfig

__all__ = [
    "DEFAULT_DRAFT_SAMPLE_METHOD",
    "RESERVED_ENGINE_ARGS",
    "check_vllm_kwargs",
    "engine_arg_names",
    "engine_args_for",
    "resolve_dtype",
    "sleeps_on_finish",
    "speculative_engine_args",
    "wants_tokenizer",
]

_GIB = 1 << 30
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def wants_tokenizer(config: VllmConfig) -> bool:
    """Whether to load the tokenizer (needed for stop strings only)."""
    setting = config["vllm_cfg"]["load_tokenizer"]
    if setting != "auto":
        return bool(setting)
    path = Path(config["model_name"])
    return not path.is_dir() or any((path / name).is_file() for name in _TOKENIZER_FILES)


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


def routing_mode(config: VllmConfig, *, use_gpus: bool) -> str | None:
    """How routed experts are read (``return_routed_experts``): ``"capture"`` in the worker
    (an eager forward), ``"native"`` by vLLM's own option (a GPU with compiled or CUDA-graph
    forwards), None when not asked.

    Raises:
        GenerationConfigError: asked on CPU without ``enforce_eager`` (a compiled forward was
            traced without the capture, and the CPU build has no own option).
    """
    if not config.get("return_routed_experts"):
        return None
    if config["vllm_cfg"]["enforce_eager"]:
        return "capture"
    if use_gpus:
        return "native"
    raise GenerationConfigError(
        "return_routed_experts is true but vllm_cfg.enforce_eager is false: on CPU a compiled "
        "forward was traced without the routing capture (and vLLM's own option needs Triton); "
        "set vllm_cfg.enforce_eager to true"
    )


def engine_env(config: VllmConfig, *, use_gpus: bool) -> dict[str, str]:
    """Environment variables each engine needs for ``config`` (set before vLLM is imported)."""
    env = {}
    if config.get("batch_invariant", False):
        env["VLLM_BATCH_INVARIANT"] = "1"
    if routing_mode(config, use_gpus=use_gpus) == "native":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # what enable_return_routed_experts runs on
    return env


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
        "max_logprobs": cfg["max_logprobs"],
        "kv_cache_dtype": cfg["kv_cache_dtype"],
        "load_format": cfg["load_format"],
        "logprobs_mode": (
            "processed_logprobs" if config.get("logprobs_mode") == "processed" else "raw_logprobs"
        ),
        "skip_tokenizer_init": not wants_tokenizer(config),
        "enable_sleep_mode": sleeps_on_finish(config, use_gpus=use_gpus),
        # Weight updates go through vLLM's transaction with this project's engine (transfer.py).
        "weight_transfer_config": {"backend": "gen"},
        # vLLM's own statistics cost every step a record; this backend counts what it reports
        # itself (get_logger_metrics). vllm_kwargs may turn them back on.
        "disable_log_stats": True,
    }
    if cfg["max_model_len"] is not None:
        args["max_model_len"] = cfg["max_model_len"]
    if use_gpus:
        args["gpu_memory_utilization"] = cfg["gpu_memory_utilization"]
        if cfg["tensor_parallel_size"] > 1:
            args["distributed_executor_backend"] = "ray"
    else:
        args["kv_cache_memory_bytes"] = int(cfg["cpu_kv_cache_gib"] * _GIB)
        # Chunked prefill splits a prompt across steps and then rewinds the row's seeded
        # generator (``Generator.set_offset``), which torch's CPU generators cannot do: the
        # engine dies once a call brings more prompt tokens than one step schedules. Without
        # it, vLLM schedules max(max_model_len, its default) tokens per step.
        args["enable_chunked_prefill"] = False
    passed = config.get("vllm_kwargs") or {}
    check_vllm_kwargs(passed)
    if not use_gpus and passed.get("enable_chunked_prefill"):
        raise GenerationConfigError(
            "`vllm_kwargs.enable_chunked_prefill` cannot be true on CPU: vLLM rewinds a "
            "chunked row's seeded generator, which torch's CPU generators cannot do, and the "
            "engine dies on the first large batch"
        )
    args.update(passed)
    if routing_mode(config, use_gpus=use_gpus) == "native":
        args["enable_return_routed_experts"] = True
    section = config.get("lora")
    if section:
        try:
            args.update(lora_engine_args(lora_settings(section)))
        except (ValueError, OSError, KeyError) as exc:
            raise GenerationConfigError(f"lora: {exc}") from exc
    speculative = speculative_engine_args(config)
    if speculative:
        args.update(speculative)
    if config.get("lm_head_fp32"):
        # vLLM's own switch (ModelConfig.head_dtype): the lm_head runs in float32, its weight
        # cast as it is applied; the sampler's log-softmax is in float32 already.
        args["hf_overrides"] = {**(passed.get("hf_overrides") or {}), "head_dtype": "float32"}
    return args


#: ``SpeculativeConfig`` keys of this project's own, not passed to vLLM.
PROJECT_KEYS = frozenset({"min_acceptance_rate"})
#: ``speculative.draft_sample_method`` of a ``draft_model`` section that leaves it out: drafts
#: drawn from the drafter, which at temperature 1 are accepted as often as drafter and target
#: agree (vLLM's default, "greedy", is accepted with the target's probability of the drafter's
#: argmax: 0.19 against 0.90 on the speculative bench's models), and which a row's seed
#: reproduces here (``seeded_drafts``).
DEFAULT_DRAFT_SAMPLE_METHOD = "probabilistic"


def speculative_engine_args(config: VllmConfig) -> dict[str, Any]:
    """The engine arguments of ``config["speculative"]`` (none when it is off): vLLM's
    ``speculative_config`` (the same keys, unset ones left out) and its per-request acceptance
    summary, which each finished request carries back (``StepOutput.speculation``) so the
    backend counts drafts without vLLM's own statistics."""
    section = config.get("speculative")
    if not section:
        return {}
    speculative = {k: v for k, v in section.items() if v is not None and k not in PROJECT_KEYS}
    if speculative["method"] == "draft_model":
        speculative.setdefault("draft_sample_method", DEFAULT_DRAFT_SAMPLE_METHOD)
    return {"speculative_config": speculative, "per_request_spec_decode_metrics": "summary"}


#: Engine arguments the backend sets itself, and the ``vllm_cfg`` key (or reason) behind each.
RESERVED_ENGINE_ARGS: dict[str, str] = {
    "model": "`model_name`",
    "tokenizer": "`model_name` (the tokenizer is read from the model directory)",
    "worker_extension_cls": "this backend's worker extension, which weight updates need",
    "weight_transfer_config": "this backend's weight-transfer engine, which weight updates need",
    "dtype": "the top-level `dtype`",
    "seed": "the top-level `seed` (each request carries its own 64-bit seed)",
    "logprobs_mode": "the top-level `logprobs_mode`",
    "skip_tokenizer_init": "`vllm_cfg.load_tokenizer`",
    "enable_sleep_mode": "`vllm_cfg.enable_sleep_mode`",
    "distributed_executor_backend": "the placement on the Ray cluster",
    "kv_cache_memory_bytes": "`vllm_cfg.cpu_kv_cache_gib` (CPU) or "
    "`vllm_cfg.gpu_memory_utilization` (CUDA)",
    "speculative_config": "the top-level `speculative` (vLLM's keys)",
    "per_request_spec_decode_metrics": "the top-level `speculative`: the backend reads each "
    "request's acceptance itself (get_logger_metrics)",
    **{key: f"`vllm_cfg.{key}`" for key in VLLM_CFG_DEFAULTS if key != "cpu_kv_cache_gib"},
}


def check_vllm_kwargs(passed: Mapping[str, Any]) -> None:
    """Refuse ``vllm_kwargs`` keys that are not fields of ``vllm.EngineArgs`` (with the closest
    one) or that the backend sets itself (with the setting to use instead).

    Raises:
        GenerationConfigError: naming ``vllm_kwargs.<key>``.
    """
    if not passed:
        return
    for key in passed:
        if key in RESERVED_ENGINE_ARGS:
            raise GenerationConfigError(
                f"`vllm_kwargs.{key}` is set by the backend: use {RESERVED_ENGINE_ARGS[key]}"
            )
    fields = engine_arg_names()
    for key in passed:
        if key not in fields:
            near = difflib.get_close_matches(key, sorted(fields), 3, 0.75)
            hint = " or ".join(f"`{n}`" for n in near)
            raise GenerationConfigError(
                f"unknown key `vllm_kwargs.{key}`: not a field of vllm.EngineArgs"
                + (f"; did you mean {hint}?" if hint else "")
            )


@functools.cache
def engine_arg_names() -> frozenset[str]:
    """The field names of the installed vLLM's ``EngineArgs`` (imports vLLM's argument module)."""
    from vllm.engine.arg_utils import EngineArgs

    return frozenset(field.name for field in dataclasses.fields(EngineArgs))
