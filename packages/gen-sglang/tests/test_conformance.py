"""The conformance suite against an SGLang server on the CPU, raw and processed logprobs: one
server for the module (a start takes about 25 s here). The logprobs mode is a flag of each
request (every server loads this package's logit processor), so the processed backend is a
view of the raw one with its config's mode changed: what a backend started in that mode sends,
to the same server."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest
import torch
from gen_interface import GenerationError, create_generation_backend
from gen_sglang import SglangGeneration
from gen_testkit.conformance import (
    ConformanceSubject,
    GenerationConformanceSuite,
    conformance_config,
)
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts
from gen_testkit.suite.async_rows import AsyncRowChecks
from gen_testkit.suite.capabilities import CapabilityProperties
from gen_testkit.suite.determinism import DeterminismProperties
from gen_testkit.suite.in_flight import InFlightUpdateChecks
from gen_testkit.suite.layout import LayoutProperties
from gen_testkit.suite.row_sampling import RowSamplingProperties
from gen_testkit.suite.staleness import StalenessChecks

SglangBackends = Callable[[str], SglangGeneration]
#: What ``FleetClient.chunks`` gives (the tests wrap it).
Chunks = Generator[dict[str, Any], None, None]


@pytest.fixture(scope="module")
def sglang_backends(tiny_qwen2: TinyModel) -> Iterator[SglangBackends]:
    """``get(logprobs_mode)``: this module's SGLang backend on ``tiny_qwen2`` in that mode,
    built from the conformance config, without the radix cache. One server, started on first
    use, serves both modes: ``"processed"`` is a view of the ``"raw"`` backend whose config
    says ``processed`` (the config is read per call; the server's arguments do not depend on
    the mode)."""
    built: dict[str, SglangGeneration] = {}

    def get(mode: str) -> SglangGeneration:
        if "raw" not in built:
            built["raw"] = SglangGeneration(
                conformance_config(
                    backend="sglang",
                    model_name=str(tiny_qwen2.path),
                    vocab_size=tiny_qwen2.vocab_size,
                    logprobs_mode="raw",
                    # The suite asks for bit-equal repeats: a cached prefix changes the last
                    # bits of SGLang's CPU logprobs (its kernels are not batch-invariant).
                    # 4,096 cache slots: the retraction test below needs rows to outgrow them.
                    sglang_cfg={"radix_cache": False, "max_total_tokens": 4096},
                )
            )
        if mode not in built:
            view = built["raw"].with_sampling()
            view.config = type(view).complete_config({**view.config, "logprobs_mode": mode})
            built[mode] = view
        return built[mode]

    yield get
    if "raw" in built:  # the views own nothing: the raw backend's shutdown stops the server
        built["raw"].shutdown()


def _failing_rows(backend: SglangGeneration) -> Callable[[bool], None]:
    """``fail_rows``: while on, every row a server ends comes back ended by an internal error,
    as SGLang reports one (``finish_reason`` abort with a 500): a real server cannot be made to
    fail rows and stay up, so the answers are rewritten on their way in."""
    answers = backend._client.chunks

    def failing(server: Any, body: dict[str, Any]) -> Chunks:
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
            backend._client.chunks = failing  # type: ignore[method-assign]
        else:
            vars(backend._client).pop("chunks", None)

    return fail_rows


class TestSglang(GenerationConformanceSuite):
    claims_score = True
    claims_weight_updates = True
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
    test_processed_logprobs_are_not_raw = CapabilityProperties.test_processed_logprobs_are_not_raw

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, sglang_backends: SglangBackends, tiny_qwen2: TinyModel) -> ConformanceSubject:
        backend = sglang_backends("processed")
        return ConformanceSubject.for_model(backend, tiny_qwen2, fail_rows=_failing_rows(backend))


class TestInFlight(InFlightUpdateChecks):
    subject = TestSglang.subject
    stages_whole_updates = True


class TestStaleness(StalenessChecks):
    subject = TestSglang.subject


class TestAsyncRows(AsyncRowChecks):
    subject = TestSglang.subject


def test_sampled_rows_draw_as_on_hf_even_when_retracted(
    sglang_backends: SglangBackends, tiny_qwen2: TinyModel
):
    """More rows than the KV cache holds (300 rows of 27 tokens against 4,096 slots): SGLang
    retracts some mid-row, drops the token their forward made and computes that position again.
    Each sampled row still draws exactly gen-hf's tokens from its seed: the processor rewinds
    the row's generator past the dropped draw."""
    backend = sglang_backends("processed")
    settings = {k: v for k, v in backend.config.items() if k != "sglang_cfg"}
    hf = create_generation_backend({**settings, "backend": "hf", "hf_cfg": {"device": "cpu"}})
    prompts = pad_prompts([list(range(20, 31))] * 300, "right")
    prompts["sample_seeds"] = torch.arange(300) * 7919 + 1
    retractions: list[int] = []
    answers = backend._client.chunks

    def counting(server: Any, body: dict[str, Any]) -> Chunks:
        for chunk in answers(server, body):
            retractions.append(int((chunk.get("meta_info") or {}).get("num_retractions") or 0))
            yield chunk

    backend._client.chunks = counting  # type: ignore[method-assign]
    sampling = {"max_new_tokens": 16, "stop_token_ids": [], "top_logprobs": 2}
    try:  # the view shares the backend's client, so the wrapper too
        got = backend.with_sampling(**sampling).generate(prompts, greedy=False)
    finally:
        vars(backend._client).pop("chunks", None)
    try:
        expected = hf.with_sampling(**sampling).generate(prompts, greedy=False)
    finally:
        hf.shutdown()
    assert max(retractions) > 0, "no row was retracted: the check tests nothing"
    assert torch.equal(got["output_ids"], expected["output_ids"])
    assert torch.equal(got["topk_ids"], expected["topk_ids"])
    torch.testing.assert_close(got["logprobs"], expected["logprobs"], rtol=0, atol=2e-5)


def test_sampled_rows_whose_prefills_outgrow_one_forward_all_come_with_their_choice(
    sglang_backends: SglangBackends,
):
    """600 rows of one 9-token prompt: 5,400 prompt tokens, more than SGLang's chunked-prefill
    size (4,096). A row whose prefill SGLang split over forwards came back without RowSampler's
    choice (the call failed); gen-sglang starts its servers with whole prefills."""
    backend = sglang_backends("processed")
    prompts = pad_prompts([list(range(40, 49))] * 600, "right")
    prompts["sample_seeds"] = torch.arange(600) * 7919 + 1
    out = backend.with_sampling(max_new_tokens=1).generate(prompts, greedy=False)
    assert out["generation_lengths"].tolist() == [1] * 600


def test_a_sampler_failure_in_the_server_fails_the_call_and_the_server_goes_on(
    sglang_backends: SglangBackends,
):
    """The processor runs inside SGLang's scheduler, where a raise would stop the server: a
    failure (here a temperature the processor cannot read) comes back in the row instead, as a
    ``GenerationError`` naming it, and the next call runs."""
    backend = sglang_backends("raw")
    answers = backend._client.chunks

    def unreadable(server: Any, body: dict[str, Any]) -> Chunks:
        for params in body["sampling_params"]:
            if "custom_params" in params:
                params["custom_params"]["temperature"] = "hot"
        yield from answers(server, body)

    prompts = pad_prompts([[5, 6, 7], [8, 9]], "left")
    backend._client.chunks = unreadable  # type: ignore[method-assign]
    try:
        with pytest.raises(GenerationError, match="sampler failed inside the SGLang server"):
            backend.generate(prompts, greedy=False)
    finally:
        vars(backend._client).pop("chunks", None)
    again = backend.generate(prompts, greedy=False)
    assert again["generation_lengths"].min() > 0
