"""The conformance suite against SGLang servers on the CPU, raw and processed logprobs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from gen_sglang import SglangGeneration
from gen_testkit.conformance import ConformanceSubject, GenerationConformanceSuite
from gen_testkit.models import TinyModel
from gen_testkit.suite.async_rows import AsyncRowChecks
from gen_testkit.suite.in_flight import InFlightUpdateChecks
from gen_testkit.suite.staleness import StalenessChecks

SglangBackends = Callable[[str], SglangGeneration]


class TestSglang(GenerationConformanceSuite):
    claims_score = True
    claims_weight_updates = True

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, sglang_backends: SglangBackends, tiny_qwen2: TinyModel) -> ConformanceSubject:
        return ConformanceSubject.for_model(sglang_backends("raw"), tiny_qwen2)


class TestSglangProcessed(TestSglang):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, sglang_backends: SglangBackends, tiny_qwen2: TinyModel) -> ConformanceSubject:
        return ConformanceSubject.for_model(sglang_backends("processed"), tiny_qwen2)


class TestInFlight(InFlightUpdateChecks):
    subject = TestSglang.subject


class TestStaleness(StalenessChecks):
    subject = TestSglang.subject


class TestAsyncRows(AsyncRowChecks):
    subject = TestSglang.subject
