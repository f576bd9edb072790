"""The servers the remote backend's tests drive, shared by the whole session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from remote_servers import ServedModels

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


@pytest.fixture(scope="session")
def served() -> Iterator[ServedModels]:
    servers = ServedModels()
    yield servers
    servers.close()
