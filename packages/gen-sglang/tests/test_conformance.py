"""The conformance suite against SGLang servers on the CPU, raw and processed logprobs: one
server per logprobs mode for the module (each start takes about 25 s here)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from gen_sglang import SglangGeneration
from gen_testkit.conformance import (
    ConformanceSubject,
    GenerationConformanceSuite,
    conformance_config,
)
from gen_testkit.models import TinyModel
from gen_testkit.suite.async_rows import AsyncRowChecks
from gen_testkit.suite.capabilities import CapabilityProperties
from gen_testkit.suite.determinism import DeterminismProperties
from gen_testkit.suite.in_flight import InFlightUpdateChecks
from gen_testkit.suite.layout import LayoutProperties
from gen_testkit.suite.row_sampling import RowSamplingProperties
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


def _failing_rows(backend: SglangGeneration) -> Callable[[bool], None]:
    """``fail_rows``: while on, every row a server ends comes back ended by an internal error,
    as SGLang reports one (``finish_reason`` abort with a 500): a real server cannot be made to
    fail rows and stay up, so the answers are rewritten on their way in."""
    answers = backend._chunks

    def failing(server: Any, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        for chunk in answers(server, body):
            meta = chunk.get("meta_info") or {}
            if meta.get("finish_reason"):
                meta["finish_reason"] = {
                    "type": "abort",
                    "message": "Internal server error: the scheduler failed (the test's fault)",
                    "status_code": 500,
                    "err_type": "InternalServerError",
                }
            yield chunk

    def fail_rows(on: bool) -> None:
        if on:
            backend._chunks = failing  # type: ignore[method-assign]
        else:
            vars(backend).pop("_chunks", None)

    return fail_rows


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
        backend = sglang_backends("raw")
        return ConformanceSubject.for_model(backend, tiny_qwen2, fail_rows=_failing_rows(backend))


class TestSglangProcessed(LayoutProperties, RowSamplingProperties, DeterminismProperties):
    """Processed logprobs go through this package's logit processor: the properties that
    depend on how rows sample. The rest of the suite does not depend on the mode."""

    claims_score = True
    samples_not_repeatable = CPU_SEEDS
    test_processed_logprobs_are_not_raw = CapabilityProperties.test_processed_logprobs_are_not_raw

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, sglang_backends: SglangBackends, tiny_qwen2: TinyModel) -> ConformanceSubject:
        backend = sglang_backends("processed")
        return ConformanceSubject.for_model(backend, tiny_qwen2, fail_rows=_failing_rows(backend))


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
