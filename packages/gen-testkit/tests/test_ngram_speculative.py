"""The reference speculative decoder (the n-gram backend with a drafter) is lossless: the
speculative properties, and the whole conformance suite, hold on it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gen_interface import GenerationConfigError
from gen_testkit.conformance import GenerationConformanceSuite
from gen_testkit.ngram import NgramGeneration
from gen_testkit.parity.oracle import NgramLogitsOracle
from gen_testkit.suite.base import ConformanceSubject, conformance_config
from gen_testkit.suite.speculative import SpeculativeProperties

VOCAB = 512
SPECULATIVE = {"method": "draft_model", "model": "ngram-drafter", "num_speculative_tokens": 3}


def _config(**extra):
    return conformance_config(backend="ngram", model_name="ngram", vocab_size=VOCAB, **extra)


def _subject(backend: NgramGeneration) -> ConformanceSubject:
    return ConformanceSubject(backend, VOCAB, backend.state_dict())


def speculative_subject(
    mode: str = "raw", backend_cls: type[NgramGeneration] = NgramGeneration
) -> Iterator[ConformanceSubject]:
    """A speculating n-gram subject (the fault suite passes broken classes)."""
    backend = backend_cls(_config(speculative=SPECULATIVE, logprobs_mode=mode))
    yield _subject(backend)
    backend.shutdown()


class TestNgramSpeculative(SpeculativeProperties):
    claims_drafter_refit = True

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
