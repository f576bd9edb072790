"""The reference speculative decoder (the n-gram backend with a drafter) is lossless: the
speculative properties, and the whole conformance suite, hold on it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gen_interface import GenerationConfigError
from gen_testkit.conformance import GenerationConformanceSuite
from gen_testkit.ngram import NgramGeneration
from gen_testkit.parity.oracle import NgramLogitsOracle
from gen_testkit.suite.base import ConformanceSubject, conformance_config
from gen_testkit.suite.speculative import SpeculativeProperties, one_row_only

VOCAB = 512
SPECULATIVE = {"method": "draft_model", "model": "ngram-drafter", "num_speculative_tokens": 3}


def _config(**extra):
    return conformance_config(backend="ngram", model_name="ngram", vocab_size=VOCAB, **extra)


def _subject(backend: NgramGeneration) -> ConformanceSubject:
    return ConformanceSubject(backend, VOCAB, backend.state_dict())


def speculative_subject(
    mode: str = "raw", backend_cls: type[NgramGeneration] = NgramGeneration, **settings: Any
) -> Iterator[ConformanceSubject]:
    """A speculating n-gram subject, ``settings`` added to its ``speculative`` section (the
    fault suite passes broken classes)."""
    backend = backend_cls(_config(speculative={**SPECULATIVE, **settings}, logprobs_mode=mode))
    yield _subject(backend)
    backend.shutdown()


class TestNgramSpeculative(SpeculativeProperties):
    claims_drafter_refit = True
    claims_batch_schedule = True

    @pytest.fixture(scope="class")
    @classmethod
    def scheduled_subject(cls) -> Iterator[ConformanceSubject]:
        k = SPECULATIVE["num_speculative_tokens"]
        yield from speculative_subject(num_speculative_tokens_per_batch_size=one_row_only(k))

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls) -> Iterator[ConformanceSubject]:
        yield from speculative_subject()

    @pytest.fixture(scope="class")
    @classmethod
    def plain_subject(cls) -> Iterator[ConformanceSubject]:
        backend = NgramGeneration(_config())
        yield _subject(backend)
        backend.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def logits_oracle(cls, plain_subject):
        return NgramLogitsOracle(plain_subject.backend.model)

    @pytest.fixture(scope="class")
    @classmethod
    def drafter_weights(cls, subject):
        return {k: v for k, v in subject.state_dict.items() if k.startswith("drafter.")}


class TestNgramSpeculativeProcessed(TestNgramSpeculative):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls) -> Iterator[ConformanceSubject]:
        yield from speculative_subject("processed")


class TestNgramSpeculativeConformance(GenerationConformanceSuite):
    """Every CONTRACT rule holds with speculation on (seeds, stops, versions, updates...)."""

    claims_score = True
    claims_weight_updates = True

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls) -> Iterator[ConformanceSubject]:
        backend = NgramGeneration(_config(speculative=SPECULATIVE, ngram={"seconds_per_step": 0}))
        yield _subject(backend)
        backend.shutdown()


def test_an_unoffered_method_is_refused_by_name():
    with pytest.raises(GenerationConfigError, match=r"speculative\.method 'ngram'"):
        NgramGeneration(_config(speculative={"method": "ngram", "num_speculative_tokens": 2}))


def test_a_drafter_below_the_acceptance_floor_is_warned_about_once(caplog):
    """The n-gram drafter accepts about a fifth of its greedy proposals: under a floor of 0.9 the
    backend warns once (naming itself), keeps speculating, and says so in its metrics."""
    import logging

    from gen_testkit.strategies import pad_prompts

    backend = NgramGeneration(_config(speculative={**SPECULATIVE, "min_acceptance_rate": 0.9}))
    batch = pad_prompts([[5, 17, 42, 8], [99, 3], [7, 7, 7]] * 8, "left")
    long = backend.with_sampling(max_new_tokens=64, stop_token_ids=[])
    with caplog.at_level(logging.WARNING, logger="gen_backend_kit.speculation"):
        for _ in range(3):
            out = long.generate(batch, greedy=True)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "NgramGeneration" in warned[0], warned
    metrics = backend.get_logger_metrics()
    assert metrics["speculative_below_break_even"] == 1
    assert metrics["speculative_recent_acceptance_rate"] < 0.9
    assert int(out["generation_lengths"].sum()) == 64 * batch.size  # it goes on speculating
    backend.shutdown()


class TestNgramSpeculativeGreedyDrafts(TestNgramSpeculative):
    """Drafts the drafter's argmax (vLLM's default ``draft_sample_method``): still lossless."""

    claims_drafter_refit = False

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls) -> Iterator[ConformanceSubject]:
        yield from speculative_subject(draft_sample_method="greedy")
