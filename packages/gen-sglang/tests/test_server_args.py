"""The flags gen-sglang starts SGLang with, without starting it."""

from __future__ import annotations

import os
from typing import Any, cast

import pytest
from gen_sglang.config import SGLANG_CFG_DEFAULTS, SglangConfig
from gen_sglang.server_args import cpu_forward_threads, server_args, server_env


def _args(**settings: Any) -> list[str]:
    config = cast(SglangConfig, {"sglang_cfg": {**SGLANG_CFG_DEFAULTS, **settings}})
    return server_args(config, "float32", cpu=True, tokenizer=False, kv_bytes=4096)


def _last(args: list[str], flag: str) -> str:
    """The value argparse keeps for ``flag``: its last one."""
    return args[len(args) - 1 - args[::-1].index(flag) + 1]


def test_prefills_are_whole_unless_extra_args_say_otherwise():
    assert _last(_args(), "--chunked-prefill-size") == "-1"
    chosen = _args(extra_args=["--chunked-prefill-size", "2048"])
    assert _last(chosen, "--chunked-prefill-size") == "2048"


def test_chunks_carry_their_new_tokens_alone():
    """``RowStream`` reads a chunk as the row's new tokens: a server streaming the whole row so
    far would repeat every earlier token."""
    assert "--incremental-streaming-output" in _args()


def test_the_sampler_and_the_cpu_build_are_always_asked_for():
    args = _args()
    assert "--enable-custom-logit-processor" in args
    assert _last(args, "--device") == "cpu" and "--skip-tokenizer-init" in args


def _env(cpu: bool = True, **settings: Any) -> dict[str, str]:
    return server_env({**SGLANG_CFG_DEFAULTS, **settings}, cpu=cpu)  # type: ignore[typeddict-item]


@pytest.mark.parametrize(
    ("cores", "replicas", "threads"), [(2, 1, 1), (8, 1, 7), (8, 2, 3), (16, 4, 3), (2, 4, 1)]
)
def test_a_cpu_server_s_forward_pass_leaves_one_core_of_its_share(
    monkeypatch: pytest.MonkeyPatch, cores: int, replicas: int, threads: int
):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    assert cpu_forward_threads(replicas, None) == threads
    assert _env(num_replicas=replicas)["OMP_NUM_THREADS"] == str(threads)


def test_cpu_threads_set_the_forward_pass_s_threads_and_a_gpu_server_gets_none():
    assert cpu_forward_threads(1, 5) == 5
    assert _env(cpu_threads=5)["OMP_NUM_THREADS"] == "5"
    gpu = _env(cpu=False, cpu_threads=5)
    assert "OMP_NUM_THREADS" not in gpu and "SGLANG_USE_CPU_ENGINE" not in gpu
    assert gpu["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1" and gpu["PYTHONPATH"]
