"""``SglangConfig``: ``GenerationConfig`` plus ``sglang_cfg``, how the SGLang servers start."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict, cast

from gen_backend_kit.settings import check_int_setting, complete_backend_settings
from gen_interface import GenerationConfig, GenerationConfigError

__all__ = ["SGLANG_CFG_DEFAULTS", "SglangConfig", "SglangSettings", "complete_sglang_config"]

Device = Literal["auto", "cpu", "cuda"]


class SglangSettings(TypedDict, total=False):
    """Settings under ``SglangConfig["sglang_cfg"]``; every key has a default."""

    python: str | None  # the interpreter of SGLang's environment; None: the managed one (CPU)
    num_replicas: int  # servers, each with the whole model; rows are spread over them (1)
    device: Device  # "auto": cuda when this machine has a GPU, else cpu ("auto")
    kv_cache_gib: float | None  # KV cache per server, GiB; None: 0.25 on the CPU, SGLang's sizing
    # CPU: threads of each server's forward pass; None: the cores of its share of the machine
    # but one (at least 1), left to the server's HTTP side and this process (None)
    cpu_threads: int | None
    max_total_tokens: int | None  # caps the KV cache's tokens further; None: no cap
    mem_fraction_static: float | None  # SGLang's; None: 1 on the CPU, SGLang's default else
    context_length: int | None  # prompt + generation at most; None: the model's
    radix_cache: bool  # reuse the KV of cached prefixes (True); see the README on exactness
    start_timeout_s: float  # how long a server may take to answer /health_generate (600)
    timeout_s: float  # longest silence of a server within one request (600)
    extra_args: list[str]  # more `sglang.launch_server` arguments, passed as they are ([])
    load_format: Literal["auto", "dummy"]  # "dummy": random weights until the first update
    # a server that dies costs its rows a re-run on the others and is replaced in the
    # background (False: a lost server breaks the whole backend, as before) (True)
    healing: bool
    max_replica_restarts: int  # replacements the fleet may start over its life; then smaller (16)
    # healing: a server with requests streaming that sends nothing on any of them this long
    # (outside weight updates) is wedged: killed, its rows run again, replaced (30)
    wedge_timeout_s: float
    # a call that does not stream tokens (generate, generate_async) gets each row from its
    # server in chunks of this many tokens, besides the first and the last: fewer messages,
    # and a cancelled call's rows may run that many steps longer (16; 1: every token)
    chunk_tokens: int


#: Defaults for every ``sglang_cfg`` key.
SGLANG_CFG_DEFAULTS: SglangSettings = {
    "python": None,
    "num_replicas": 1,
    "device": "auto",
    "kv_cache_gib": None,
    "cpu_threads": None,
    "max_total_tokens": None,
    "mem_fraction_static": None,
    "context_length": None,
    "radix_cache": True,
    "start_timeout_s": 600.0,
    "timeout_s": 600.0,
    "extra_args": [],
    "load_format": "auto",
    "healing": True,
    "max_replica_restarts": 16,
    "wedge_timeout_s": 30.0,
    "chunk_tokens": 16,
}


class SglangConfig(GenerationConfig, total=False):
    """``GenerationConfig`` plus the SGLang backend's settings (see ``SglangSettings``)."""

    sglang_cfg: SglangSettings


def complete_sglang_config(config: Mapping[str, Any]) -> SglangConfig:
    """A validated copy of ``config`` with ``sglang_cfg``'s defaults filled in.

    Raises:
        GenerationConfigError: a key is unknown, or a field is out of range (``sglang_cfg``
            fields are named ``sglang_cfg.<key>``).
    """
    out, cfg = complete_backend_settings(
        config, "sglang_cfg", SGLANG_CFG_DEFAULTS, schema=SglangConfig
    )
    if cfg["python"] is not None and not isinstance(cfg["python"], str):
        raise GenerationConfigError(
            f"sglang_cfg.python must be the path of a Python interpreter, got {cfg['python']!r}"
        )
    if cfg["device"] not in ("auto", "cpu", "cuda"):
        raise GenerationConfigError(
            f"sglang_cfg.device must be 'auto', 'cpu' or 'cuda', got {cfg['device']!r}"
        )
    check_int_setting(cfg, "sglang_cfg", "num_replicas")
    if cfg["cpu_threads"] is not None:
        check_int_setting(cfg, "sglang_cfg", "cpu_threads")
    for key in ("max_total_tokens", "context_length"):
        if cfg[key] is not None:
            check_int_setting(cfg, "sglang_cfg", key, minimum=2)
    gib = cfg["kv_cache_gib"]
    if gib is not None and not (_is_number(gib) and gib > 0):
        raise GenerationConfigError(
            f"sglang_cfg.kv_cache_gib must be a number of GiB > 0 or null, got {gib!r}"
        )
    fraction = cfg["mem_fraction_static"]
    if fraction is not None and not (_is_number(fraction) and 0 < fraction <= 1):
        raise GenerationConfigError(
            f"sglang_cfg.mem_fraction_static must be in (0, 1] or null, got {fraction!r}"
        )
    for key in ("start_timeout_s", "timeout_s", "wedge_timeout_s"):
        if not (_is_number(cfg[key]) and cfg[key] > 0):
            raise GenerationConfigError(f"sglang_cfg.{key} must be a number > 0, got {cfg[key]!r}")
    extra = cfg["extra_args"]
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise GenerationConfigError(
            f"sglang_cfg.extra_args must be a list of strings, got {extra!r}"
        )
    for key in ("radix_cache", "healing"):
        if not isinstance(cfg[key], bool):
            raise GenerationConfigError(f"sglang_cfg.{key} must be true or false, got {cfg[key]!r}")
    check_int_setting(cfg, "sglang_cfg", "max_replica_restarts", minimum=0)
    check_int_setting(cfg, "sglang_cfg", "chunk_tokens")
    if cfg["load_format"] not in ("auto", "dummy"):
        raise GenerationConfigError(
            f"sglang_cfg.load_format must be 'auto' or 'dummy', got {cfg['load_format']!r}"
        )
    out["sglang_cfg"] = cfg
    return cast(SglangConfig, out)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)
