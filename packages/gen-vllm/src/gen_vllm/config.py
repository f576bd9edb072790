"""``VllmConfig``: ``GenerationConfig`` plus ``vllm_cfg``, the engine's own settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict, cast

from gen_backend_kit.settings import check_int_setting, complete_backend_settings
from gen_backend_kit.speculation import refuse_unoffered_speculation
from gen_interface import GenerationConfig, GenerationConfigError, SpeculativeConfig
from gen_interface.nemo_rl_keys import falsy
from gen_interface.schema import ForeignKey, ForeignKeys

__all__ = [
    "NEMO_RL_ALIASES",
    "SPECULATIVE_METHODS",
    "VLLM_CFG_DEFAULTS",
    "VLLM_FOREIGN_KEYS",
    "VllmConfig",
    "VllmSpecificArgs",
    "complete_vllm_config",
]


class VllmSpecificArgs(TypedDict, total=False):
    """Engine settings under ``VllmConfig["vllm_cfg"]``; every key has a default."""

    tensor_parallel_size: int  # GPUs per engine (1). Data-parallel replicas = bundles / this.
    gpu_memory_utilization: float  # CUDA: fraction of each GPU for weights + KV cache (0.8)
    max_model_len: int | None  # longest prompt + generation; None = the model's limit
    cpu_kv_cache_gib: float  # CPU: KV-cache size per engine in GiB (1.0)
    # CPU: threads of each engine's forward pass; None: the cores of its share of the machine but
    # one (at least 1), left for scheduling and messages, as vLLM's own server does (None)
    cpu_threads: int | None
    kv_cache_dtype: KvCacheDtype  # KV-cache element type ("auto": the model's dtype)
    enforce_eager: bool  # no CUDA graphs / torch.compile (True: fast start, needed on CPU)
    enable_prefix_caching: bool  # reuse KV of shared prompt prefixes across calls (True)
    max_num_seqs: int  # most sequences an engine runs at once (256)
    max_logprobs: int  # the most top logprobs a row may ask for (top_logprobs) (20)
    load_format: LoadFormat  # "auto": read the checkpoint; "dummy": the first update brings them
    load_tokenizer: bool | Literal["auto"]  # tokenizer for stop strings ("auto": if present)
    enable_sleep_mode: bool | Literal["auto"]  # sleep in finish ("auto": colocated on CUDA)
    startup_timeout_s: float  # how long an engine may take to start (900)
    generate_timeout_s: float  # how long one generate or score call may take (3600)
    update_timeout_s: float  # how long a weight update may take (900)
    control_timeout_s: float  # how long sleep, wake-up or a cache reset may take (300)
    # keep the last committed weights readable in every worker (one copy of the model, in host
    # memory) and take weight updates as deltas against them (False: every tensor comes whole)
    weight_deltas: bool
    # a replica that dies or wedges costs its rows a re-run on the others and is replaced in the
    # background (False: any lost worker breaks the whole backend, as before) (True)
    healing: bool
    max_replica_restarts: int  # replacements the fleet may start over its life; then smaller (16)
    wedge_timeout_s: float  # a replica holding rows with no progress this long is dead (30)
    # the most a replacement's weight load, or any replica's part of a refit, may take while
    # healing; a replica past it is evicted rather than holding the refit (300)
    refit_deadline_s: float
    # NeMo RL's names, translated by complete_vllm_config and then dropped:
    precision: str  # the top-level `dtype` ("bfloat16", "float16", "float32")
    skip_tokenizer_init: bool  # not `load_tokenizer`
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"]  # the top-level logprobs_mode
    async_engine: bool  # accepted either way: the engine core is always asynchronous
    enable_return_routed_experts: bool  # the top-level return_routed_experts


KvCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"]
LoadFormat = Literal["auto", "dummy"]

#: Defaults for every ``vllm_cfg`` key but NeMo RL's translated names.
VLLM_CFG_DEFAULTS: VllmSpecificArgs = {
    "tensor_parallel_size": 1,
    "gpu_memory_utilization": 0.8,
    "max_model_len": None,
    "cpu_kv_cache_gib": 1.0,
    "cpu_threads": None,
    "kv_cache_dtype": "auto",
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "max_num_seqs": 256,
    "max_logprobs": 20,
    "load_format": "auto",
    "load_tokenizer": "auto",
    "enable_sleep_mode": "auto",
    "startup_timeout_s": 900.0,
    "generate_timeout_s": 3600.0,
    "update_timeout_s": 900.0,
    "control_timeout_s": 300.0,
    "weight_deltas": False,
    "healing": True,
    "max_replica_restarts": 16,
    "wedge_timeout_s": 30.0,
    "refit_deadline_s": 300.0,
}

#: ``vllm_cfg`` keys of NeMo RL's that are translated to this project's names.
NEMO_RL_ALIASES = (
    "precision",
    "skip_tokenizer_init",
    "logprobs_mode",
    "async_engine",
    "enable_return_routed_experts",
)


#: The ``speculative.method`` values this backend honours (checked on vLLM's CPU build: a
#: drafter model with the target's vocabulary, and n-gram lookup in the row itself). vLLM's
#: "mtp", "eagle" and "eagle3" need prediction heads that were not verified here: refused.
SPECULATIVE_METHODS: frozenset[str] = frozenset({"draft_model", "ngram"})


class VllmConfig(GenerationConfig, total=False):
    """``GenerationConfig`` plus the vLLM engine settings (see ``VllmSpecificArgs``)."""

    vllm_cfg: VllmSpecificArgs
    vllm_kwargs: dict[str, Any]  # any other vllm.EngineArgs field, checked against vLLM's ({})


def complete_vllm_config(config: Mapping[str, Any]) -> VllmConfig:
    """A copy of ``config`` with every ``vllm_cfg`` default filled in, validated.

    The generation keys must already be complete (``configure_generation_config``). NeMo RL's
    ``vllm_cfg`` names (``NEMO_RL_ALIASES``) are translated; its other keys follow
    ``VLLM_FOREIGN_KEYS``.

    Raises:
        GenerationConfigError: a key is unknown, or a field is missing or out of range; fields
            are named by their path (``vllm_cfg.<key>``).
    """
    out, cfg = complete_backend_settings(
        _with_speculative_alias(config),
        "vllm_cfg",
        VLLM_CFG_DEFAULTS,
        schema=VllmConfig,
        foreign=VLLM_FOREIGN_KEYS,
    )
    _translate_nemo_rl_names(out, cfg, given=out.get("vllm_cfg") or {})
    check_int_setting(cfg, "vllm_cfg", "tensor_parallel_size")
    check_int_setting(cfg, "vllm_cfg", "max_num_seqs")
    check_int_setting(cfg, "vllm_cfg", "max_logprobs", minimum=0)
    if cfg["max_model_len"] is not None:
        check_int_setting(cfg, "vllm_cfg", "max_model_len")
    if cfg["cpu_threads"] is not None:
        check_int_setting(cfg, "vllm_cfg", "cpu_threads")
    _fraction(cfg, "gpu_memory_utilization")
    _positive_number(cfg, "cpu_kv_cache_gib")
    for key in (
        "startup_timeout_s",
        "generate_timeout_s",
        "update_timeout_s",
        "control_timeout_s",
        "wedge_timeout_s",
        "refit_deadline_s",
    ):
        _positive_number(cfg, key)
    check_int_setting(cfg, "vllm_cfg", "max_replica_restarts", minimum=0)

    if cfg["weight_deltas"] and out.get("lora"):
        raise GenerationConfigError(
            "`vllm_cfg.weight_deltas` with `lora`: an adapter refit is already small and is "
            "sent whole; turn weight_deltas off"
        )
    _check_speculation(out, cfg)
    out["vllm_cfg"] = cfg
    out.setdefault("vllm_kwargs", {})
    return cast(VllmConfig, out)


_SPECULATIVE_KEYS = frozenset(SpeculativeConfig.__annotations__)


def _with_speculative_alias(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """``config`` with NeMo RL's ``vllm_kwargs.speculative_config`` moved to ``speculative``
    (vLLM's names are this project's), or ``config`` itself when it has none."""
    passed = config.get("vllm_kwargs")
    if not isinstance(passed, Mapping) or "speculative_config" not in passed:
        return config
    section = passed["speculative_config"]
    out = dict(config)
    out["vllm_kwargs"] = {k: v for k, v in passed.items() if k != "speculative_config"}
    if section is None:
        return out
    if config.get("speculative") is not None:
        raise GenerationConfigError(
            "`vllm_kwargs.speculative_config` and `speculative` are both set: set one of them "
            "(`speculative` is this project's name; NeMo RL's is translated to it)"
        )
    if not isinstance(section, Mapping):
        raise GenerationConfigError(
            f"`vllm_kwargs.speculative_config` must be a dict, got {section!r}"
        )
    unknown = sorted(set(section) - _SPECULATIVE_KEYS)
    if unknown:
        raise GenerationConfigError(
            f"`vllm_kwargs.speculative_config` has key(s) {unknown} that this backend does not "
            f"offer; its keys are {sorted(_SPECULATIVE_KEYS)} (the top-level `speculative`)"
        )
    out["speculative"] = dict(section)
    return out


def _check_speculation(out: Mapping[str, Any], cfg: Mapping[str, Any]) -> None:
    """Refuse a ``speculative`` method this backend does not offer, and the settings vLLM does
    not honour under speculation (each by name)."""
    section = out.get("speculative")
    refuse_unoffered_speculation(out, "VllmGeneration", SPECULATIVE_METHODS)
    if not section:
        return
    method = section["method"]
    if out.get("return_routed_experts"):
        raise GenerationConfigError(
            f"return_routed_experts with speculative (method {method!r}): a speculative step "
            "routes draft positions the target may reject, so the routing read would not be "
            "the emitted tokens'; turn one of them off"
        )
    if float(out.get("min_p") or 0.0) > 0:
        raise GenerationConfigError(
            f"min_p = {out['min_p']} with speculative (method {method!r}): vLLM's speculative "
            "sampler has no min_p (it refuses such requests), so rows cannot be sampled as "
            "asked; set min_p to 0 or leave speculative out"
        )
    if method == "draft_model" and out.get("lora"):
        raise GenerationConfigError(
            "speculative.method 'draft_model' with `lora`: the drafter's weights and the "
            "adapter would each be a refit group of their own, which this backend does not "
            "offer together; leave one of them out"
        )
    if method == "draft_model" and cfg["load_format"] == "dummy":
        raise GenerationConfigError(
            "speculative.method 'draft_model' with vllm_cfg.load_format 'dummy' (a config made "
            "with is_eval=False): vLLM builds the drafter with the target's load format, so the "
            "drafter would keep random weights until an update carries the drafter's (its "
            "'drafter.' group) and propose nothing worth verifying; set vllm_cfg.load_format "
            "to 'auto'"
        )


def _translate_nemo_rl_names(
    out: dict[str, Any], cfg: dict[str, Any], given: Mapping[str, Any]
) -> None:
    precision = cfg.pop("precision", None)
    if precision is not None:
        if precision not in _PRECISIONS:
            raise GenerationConfigError(
                f"`vllm_cfg.precision` = {precision!r} is not supported: quantised rollouts are "
                f"not; use one of {_PRECISIONS} (or the top-level `dtype`)"
            )
        if out.get("dtype", "auto") not in ("auto", precision):
            raise GenerationConfigError(
                f"`vllm_cfg.precision` ({precision!r}) contradicts `dtype` ({out['dtype']!r}): "
                "set one of them (`dtype` is this project's name)"
            )
        out["dtype"] = precision
    skip = cfg.pop("skip_tokenizer_init", None)
    if skip is not None:
        if "load_tokenizer" in given and given["load_tokenizer"] not in ("auto", not skip):
            raise GenerationConfigError(
                "`vllm_cfg.skip_tokenizer_init` contradicts `vllm_cfg.load_tokenizer`: set one "
                "of them (`load_tokenizer` is this project's name)"
            )
        cfg["load_tokenizer"] = not skip
    mode = cfg.pop("logprobs_mode", None)
    if mode is not None:
        wanted = mode.removesuffix("_logprobs")
        if out.get("logprobs_mode", "raw") == "processed" and wanted == "raw":
            raise GenerationConfigError(
                "`vllm_cfg.logprobs_mode` ('raw_logprobs') contradicts `logprobs_mode` "
                "('processed'): set the top-level `logprobs_mode` only"
            )
        out["logprobs_mode"] = wanted
    cfg.pop("async_engine", None)
    routed = cfg.pop("enable_return_routed_experts", None)
    if routed is not None:
        if out.get("return_routed_experts") and not routed:
            raise GenerationConfigError(
                "`vllm_cfg.enable_return_routed_experts` (false) contradicts "
                "`return_routed_experts` (true): set the top-level `return_routed_experts` only"
            )
        out["return_routed_experts"] = bool(out.get("return_routed_experts")) or bool(routed)


_PRECISIONS = ("float32", "bfloat16", "float16")


def _only_one(reason: str) -> ForeignKey:
    return ForeignKey.only(reason, 1, None)


#: NeMo RL's ``vllm_cfg`` keys that this backend does not declare: accepted while off.
VLLM_FOREIGN_KEYS: ForeignKeys = {
    "vllm_cfg": {
        "engine_kwargs": falsy(
            "engine arguments go in the top-level `vllm_kwargs` (NeMo RL's name), where each "
            "is checked against vllm.EngineArgs"
        ),
        "pipeline_parallel_size": _only_one(
            "pipeline parallelism is not supported: an engine is tensor_parallel_size GPUs on "
            "one node; use tensor_parallel_size, and more replicas to scale out"
        ),
        "expert_parallel_size": _only_one(
            "expert parallelism is not supported: MoE models run tensor parallel "
            "(tensor_parallel_size)"
        ),
        "enable_expert_parallel": falsy(
            "expert parallelism is not supported: MoE models run tensor parallel "
            "(tensor_parallel_size)"
        ),
        "distributed_executor_backend": falsy(
            "each engine runs in a Ray actor the backend places; the executor inside it is the "
            "backend's choice"
        ),
        "quantization_ignored_layer_kws": falsy("applies to fp8 precision only, which is refused"),
        "limit_mm_per_prompt": falsy("multimodal models are not supported"),
        "cap_max_tokens_to_context": ForeignKey(
            "accepted either way: a row always stops at the context limit, marked truncated"
        ),
        "use_tqdm": ForeignKey("unread: no progress bar; generate logs through `logging`"),
        "use_deep_gemm": ForeignKey("unread: DeepGEMM serves fp8 precision, which is refused"),
        "num_first_layers_in_bf16": falsy("applies to fp8 precision only, which is refused"),
        "num_last_layers_in_bf16": falsy("applies to fp8 precision only, which is refused"),
        "enable_vllm_metrics_logger": ForeignKey(
            "unread: vLLM's engine metrics are not collected into the training loop's logger"
        ),
        "vllm_metrics_logger_interval": ForeignKey("unread: see enable_vllm_metrics_logger"),
        "env_vars": falsy(
            "set environment variables in the process that starts Ray; workers inherit them"
        ),
        **{
            key: falsy(
                "the backend starts no HTTP server of its own: serve it with gen-serve "
                "(`gen-serve --backend vllm`), which speaks vLLM's HTTP protocol"
            )
            for key in (
                "expose_http_server",
                "http_server_serving_chat_kwargs",
                "tool_parser_plugin",
                "reasoning_parser_plugin",
                "http_refit_api_key_env_var",
                "http_refit_server_port",
                "zmq_refit_server_port",
            )
        },
        **{
            key: falsy("multimodal and MXFP8 models are not supported")
            for key in ("video", "is_mx", "reset_encoder_cache_after_weight_update")
        },
    }
}


def _positive_number(cfg: Mapping[str, Any], key: str) -> None:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise GenerationConfigError(f"vllm_cfg.{key} must be a number > 0, got {value!r}")


def _fraction(cfg: Mapping[str, Any], key: str) -> None:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise GenerationConfigError(f"vllm_cfg.{key} must be in (0, 1], got {value!r}")
