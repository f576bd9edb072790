"""Rows streamed by generate_async, weight updates while rows run and the staleness bound, on a
real vLLM engine (the testkit's checks)."""

import pytest
from gen_testkit.suite.async_rows import AsyncRowChecks
from gen_testkit.suite.base import ConformanceSubject
from gen_testkit.suite.in_flight import InFlightUpdateChecks
from gen_testkit.suite.staleness import StalenessChecks


class TestInFlightUpdates(InFlightUpdateChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, engines, tiny_qwen2):
        backend = engines.get(tiny_qwen2, replicas=1)
        return ConformanceSubject(backend, tiny_qwen2.vocab_size, tiny_qwen2.state_dict())


class TestAsyncRows(AsyncRowChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, engines, tiny_qwen2):
        backend = engines.get(tiny_qwen2, replicas=2)
        return ConformanceSubject(backend, tiny_qwen2.vocab_size, tiny_qwen2.state_dict())


class TestStaleness(StalenessChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, engines, tiny_qwen2):
        backend = engines.get(tiny_qwen2, replicas=1)
        return ConformanceSubject(backend, tiny_qwen2.vocab_size, tiny_qwen2.state_dict())
