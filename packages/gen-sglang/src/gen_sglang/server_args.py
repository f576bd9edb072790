"""The command-line flags gen-sglang starts its SGLang servers with, from the config."""

from __future__ import annotations

from gen_sglang.config import SglangConfig
from gen_sglang.kv_cache import kv_cache_args

__all__ = ["server_args"]


def server_args(
    config: SglangConfig, dtype: str, *, cpu: bool, tokenizer: bool, kv_bytes: int
) -> list[str]:
    """The flags an SGLang server of ``config`` starts with (``dtype``; ``cpu``: this
    machine's CPU build; ``tokenizer``: the server tokenizes; ``kv_bytes``: a token's KV bytes,
    for the cache's size); ``sglang_cfg.extra_args`` come last, so they win."""
    settings = config["sglang_cfg"]
    args = ["--dtype", dtype, "--weight-version", "0", "--enable-custom-logit-processor"]
    # Whole prefills: a request whose prefill SGLang splits over forwards (more prompt tokens in
    # one batch than --chunked-prefill-size) gets no choice from RowSampler; vLLM runs without
    # chunked prefill here too. The last of repeated flags wins, so extra_args may set it.
    args += ["--chunked-prefill-size", "-1"]
    # An idle scheduler otherwise polls at 100% of a core, starving whatever runs beside it.
    args += ["--load-format", settings["load_format"], "--random-seed", "0", "--sleep-on-idle"]
    if cpu:
        args += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
    args += kv_cache_args(settings, kv_bytes, cpu=cpu)
    if settings["context_length"] is not None:
        args += ["--context-length", str(settings["context_length"])]
    if not settings["radix_cache"]:
        args.append("--disable-radix-cache")
    if not tokenizer:
        args.append("--skip-tokenizer-init")
    return args + list(settings["extra_args"])
