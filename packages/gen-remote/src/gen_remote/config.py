"""``RemoteConfig``: ``GenerationConfig`` plus ``remote_cfg``, where the server is and how to
reach it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict, cast

from gen_backend_kit.settings import check_int_setting, complete_backend_settings
from gen_interface import GenerationConfig, GenerationConfigError

__all__ = [
    "REMOTE_CFG_DEFAULTS",
    "Dialect",
    "RemoteConfig",
    "RemoteSettings",
    "complete_remote_config",
    "remote_settings",
]

#: Which protocol the server speaks: this project's ``gen-serve`` (everything the interface
#: offers) or vLLM's own ``vllm serve`` (generation and scoring; see the README).
Dialect = Literal["auto", "gen-serve", "vllm"]


class RemoteSettings(TypedDict, total=False):
    """Settings under ``RemoteConfig["remote_cfg"]``; every key but ``base_url`` has a default."""

    base_url: str  # the server, e.g. "http://10.0.0.5:8000" (required)
    api_key: str | None  # sent as "Authorization: Bearer <key>" (None)
    dialect: Dialect  # "auto": gen-serve when it answers /backend_info, else vllm ("auto")
    connect_timeout_s: float  # how long connecting may take before the call fails (5)
    timeout_s: float | None  # longest silence of the server within one call (600; None: none)
    max_connections: int  # connections to the server at most; more rows wait for one (256)


#: Defaults for every ``remote_cfg`` key but ``base_url``.
REMOTE_CFG_DEFAULTS: RemoteSettings = {
    "api_key": None,
    "dialect": "auto",
    "connect_timeout_s": 5.0,
    "timeout_s": 600.0,
    "max_connections": 256,
}


class RemoteConfig(GenerationConfig, total=False):
    """``GenerationConfig`` plus the remote backend's settings (see ``RemoteSettings``).

    The sampling keys (``temperature``, ``max_new_tokens``, ...) are this client's: every row is
    sent with its own resolved settings, whatever the server's backend was configured with.
    ``model_name``, ``pad_token_id`` and ``stop_token_ids`` default to the server's.
    """

    remote_cfg: RemoteSettings


def remote_settings(config: Mapping[str, Any]) -> RemoteSettings:
    """``config["remote_cfg"]`` with every default filled in, checked (the rest of the config
    is checked by ``complete_remote_config`` once the server's defaults are known).

    Raises:
        GenerationConfigError: ``remote_cfg`` is missing, ``base_url`` is not an http(s) URL,
            or a setting is out of range (named ``remote_cfg.<key>``).
    """
    given = config.get("remote_cfg")
    if not isinstance(given, Mapping):
        raise GenerationConfigError(
            "backend 'remote' needs remote_cfg.base_url, the server's URL: "
            "{'backend': 'remote', 'remote_cfg': {'base_url': 'http://127.0.0.1:8000'}}"
        )
    cfg: dict[str, Any] = {**REMOTE_CFG_DEFAULTS, **given}
    url = cfg.get("base_url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise GenerationConfigError(
            f"remote_cfg.base_url must be the server's http(s) URL, e.g. "
            f"'http://127.0.0.1:8000', got {url!r}"
        )
    if cfg["dialect"] not in ("auto", "gen-serve", "vllm"):
        raise GenerationConfigError(
            f"remote_cfg.dialect must be 'auto', 'gen-serve' or 'vllm', got {cfg['dialect']!r}"
        )
    for key in ("connect_timeout_s", "timeout_s"):
        value = cfg[key]
        if value is None and key == "timeout_s":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise GenerationConfigError(f"remote_cfg.{key} must be a number > 0, got {value!r}")
    check_int_setting(cfg, "remote_cfg", "max_connections")
    if cfg["api_key"] is not None and not isinstance(cfg["api_key"], str):
        raise GenerationConfigError("remote_cfg.api_key must be a string or null")
    return cast(RemoteSettings, cfg)


def complete_remote_config(config: Mapping[str, Any]) -> RemoteConfig:
    """A validated copy of a complete ``config`` (generation keys filled), ``remote_cfg``
    with its defaults.

    Raises:
        GenerationConfigError: a key is unknown, or a field is missing or out of range.
    """
    out, _ = complete_backend_settings(config, "remote_cfg", {}, schema=RemoteConfig)
    out["remote_cfg"] = remote_settings(config)
    return cast(RemoteConfig, out)
