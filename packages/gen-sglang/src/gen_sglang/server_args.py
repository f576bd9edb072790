"""The command-line flags and the environment gen-sglang starts its SGLang servers with, from
the config."""

from __future__ import annotations

import os

from gen_sglang.config import SglangConfig, SglangSettings
from gen_sglang.environment import support_dir
from gen_sglang.kv_cache import kv_cache_args

__all__ = ["cpu_forward_threads", "server_args", "server_env"]


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
    # Chunks carry their new tokens alone (``rows.RowStream``), not the whole row so far.
    args.append("--incremental-streaming-output")
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


def server_env(settings: SglangSettings, *, cpu: bool) -> dict[str, str]:
    """The variables an SGLang server starts with, beside this process's own: the support
    directory on its path (``RowSampler``, the CPU shims); raw logprobs for greedy rows (sampled
    rows report ``RowSampler``'s own); on the CPU, SGLang's CPU engine and the forward pass's
    threads (``cpu_forward_threads``)."""
    env = {"PYTHONPATH": ":".join(support_dir(cpu=cpu)), "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    if cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        threads = cpu_forward_threads(settings["num_replicas"], settings["cpu_threads"])
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def cpu_forward_threads(replicas: int, asked: int | None) -> int:
    """The threads of each CPU server's forward pass: ``asked`` (``sglang_cfg.cpu_threads``),
    else the cores of one server's share of this machine but one, at least one.

    SGLang's forward pass on the CPU runs on every core by default; its threads wait for each
    other at every parallel operation, so whenever the server's HTTP side, its detokenizer or
    this process takes a core, the whole pass waits, and the waiting threads spin. Measured on
    two cores at batch 64 (``tools/bench/sglang_step_speed.py``): with two threads the scheduler
    spent 5.3 CPU seconds on a run of 3.1 s; with one, 2.0 CPU seconds on a run of 2.0-2.2 s.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return asked or max(1, (cores or 1) // max(1, replicas) - 1)
