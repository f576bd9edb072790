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
def backend(tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]) -> Iterator[HfGeneration]:
    backend = HfGeneration(make_config(tiny_qwen2, stop_token_ids=[]))
    yield backend
    backend.shutdown()


class TestInFlightUpdates(InFlightUpdateChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, backend: HfGeneration, tiny_qwen2: TinyModel) -> ConformanceSubject:
        return ConformanceSubject(backend, tiny_qwen2.vocab_size, tiny_qwen2.state_dict())


class TestAsyncRows(AsyncRowChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, backend: HfGeneration, tiny_qwen2: TinyModel) -> ConformanceSubject:
        return ConformanceSubject(backend, tiny_qwen2.vocab_size, tiny_qwen2.state_dict())


class TestStaleness(StalenessChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, backend: HfGeneration, tiny_qwen2: TinyModel) -> ConformanceSubject:
        return ConformanceSubject(backend, tiny_qwen2.vocab_size, tiny_qwen2.state_dict())
