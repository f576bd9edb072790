"""Servers for the tests: each on 127.0.0.1, on a free port, in a thread of this process (or, for
vLLM's own server, in a process of its own), shared by every test that needs it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from servers import ServedModels, ServerThread, served_models

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


@pytest.fixture(scope="session")
def served() -> Iterator[ServedModels]:
    """The session's servers (``served_models``: gen-remote's tests use the same ones)."""
    servers = served_models()
    yield servers
    servers.close()


@pytest.fixture(scope="session")
def hf_server(served: ServedModels, tiny_qwen2: Any) -> ServerThread:
    """gen-serve over gen-hf on the tiny Qwen2."""
    return served.get("hf", tiny_qwen2)


@pytest.fixture(scope="session")
def vllm_server(served: ServedModels, tiny_qwen2: Any) -> ServerThread:
    """gen-serve over gen-vllm (one CPU engine) on the tiny Qwen2."""
    return served.get("vllm", tiny_qwen2)


@pytest.fixture(params=["hf", "vllm"])
def any_server(request: pytest.FixtureRequest) -> ServerThread:
    """Each test that takes it runs on both backends."""
    return request.getfixturevalue(f"{request.param}_server")
