"""The servers the remote backend's tests drive, shared by the whole session (with gen-serve's
tests too: ``servers.served_models``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from servers import ServedModels, served_models

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


@pytest.fixture(scope="session")
def served() -> Iterator[ServedModels]:
    servers = served_models()
    yield servers
    servers.close()
