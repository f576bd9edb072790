"""Weight updates while rows run in the transformers backend, both modes, the staleness bound,
and rows streamed by ``generate_async`` as the decode loop finishes them (the testkit's checks)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from gen_hf import HfConfig, HfGeneration
from gen_testkit.models import TinyModel
from gen_testkit.suite.async_rows import AsyncRowChecks
from gen_testkit.suite.base import ConformanceSubject
from gen_testkit.suite.in_flight import InFlightUpdateChecks
from gen_testkit.suite.staleness import StalenessChecks


@pytest.fixture(scope="module")
def shared_subject(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
) -> Iterator[ConformanceSubject]:
    """One backend for every check in this module (each check leaves it as it found it)."""
    backend = HfGeneration(make_config(tiny_qwen2, stop_token_ids=[]))
    yield ConformanceSubject.for_model(backend, tiny_qwen2)
    backend.shutdown()


class OnTheSharedBackend:
    """Points a testkit check class's ``subject`` at the module's one backend."""

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, shared_subject: ConformanceSubject) -> ConformanceSubject:
        return shared_subject


class TestInFlightUpdates(OnTheSharedBackend, InFlightUpdateChecks):
    pass


class TestAsyncRows(OnTheSharedBackend, AsyncRowChecks):
    pass


class TestStaleness(OnTheSharedBackend, StalenessChecks):
    pass
