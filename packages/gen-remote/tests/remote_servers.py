"""Test servers for the remote backend: the session's gen-serve servers on 127.0.0.1 over gen-hf
or over a gen-vllm CPU engine (``servers.ServedModels``, shared with gen-serve's tests), and the
client config that reaches one."""

from __future__ import annotations

from typing import Any

from servers import ServedModels

__all__ = ["ServedModels", "remote_config"]


def remote_config(server: Any, **extra: Any) -> dict[str, Any]:
    """A remote backend's config for ``server`` (anything with its ``url``)."""
    return {"backend": "remote", "remote_cfg": {"base_url": server.url}, **extra}
