"""The conformance suite against SGLang servers on the CPU, raw and processed logprobs: one
server per logprobs mode for the module (each start takes about 25 s here)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from gen_sglang import SglangGeneration
from gen_testkit.conformance import (
    ConformanceSubject,
    GenerationConformanceSuite,
    conformance_config,
)
from gen_testkit.models import TinyModel
from gen_testkit.suite.async_rows import AsyncRowChecks
from gen_testkit.suite.in_flight import InFlightUpdateChecks
from gen_testkit.suite.staleness import StalenessChecks

SglangBackends = Callable[[str], SglangGeneration]


@pytest.fixture(scope="module")
def sglang_backends(tiny_qwen2: TinyModel) -> Iterator[SglangBackends]:
    """``get(logprobs_mode)``: this module's SGLang backend on ``tiny_qwen2`` in that mode,
    started on first use, built from the conformance config, without the radix cache."""
    built: dict[str, SglangGeneration] = {}

    def get(mode: str) -> SglangGeneration:
        if mode not in built:
            built[mode] = SglangGeneration(
                conformance_config(
                    backend="sglang",
                    model_name=str(tiny_qwen2.path),
                    vocab_size=tiny_qwen2.vocab_size,
                    logprobs_mode=mode,
                    # The suite asks for bit-equal repeats: a cached prefix changes the last
                    # bits of SGLang's CPU logprobs (its kernels are not batch-invariant).
                    sglang_cfg={"radix_cache": False},
                )
            )
        return built[mode]

    yield get
    for backend in built.values():
        backend.shutdown()


#: Why sampled rows do not repeat here (see gen-sglang's README).
CPU_SEEDS = (
    "SGLang honours a request's sampling_seed only in its deterministic-inference mode, which "
    "needs a GPU attention backend (fa3, flashinfer, triton); on the CPU each sample is fresh"
)


class TestSglang(GenerationConformanceSuite):
    claims_score = True
    claims_weight_updates = True
    samples_not_repeatable = CPU_SEEDS
    stages_whole_updates = True

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
    samples_not_repeatable = CPU_SEEDS
    stages_whole_updates = True


class TestStaleness(StalenessChecks):
    subject = TestSglang.subject
    samples_not_repeatable = CPU_SEEDS


class TestAsyncRows(AsyncRowChecks):
    subject = TestSglang.subject
    samples_not_repeatable = CPU_SEEDS
