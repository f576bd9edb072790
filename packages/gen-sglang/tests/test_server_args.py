"""The flags gen-sglang starts SGLang with, without starting it."""

from __future__ import annotations

from typing import Any, cast

from gen_sglang.config import SGLANG_CFG_DEFAULTS, SglangConfig
from gen_sglang.server_args import server_args


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


def test_the_sampler_and_the_cpu_build_are_always_asked_for():
    args = _args()
    assert "--enable-custom-logit-processor" in args
    assert _last(args, "--device") == "cpu" and "--skip-tokenizer-init" in args
