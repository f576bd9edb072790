"""The conformance suite against the testkit's own n-gram backend, in both logprob modes."""

import pytest
from gen_testkit.conformance import (
    ConformanceSubject,
    GenerationConformanceSuite,
    conformance_config,
)
from gen_testkit.ngram import NgramGeneration
from gen_testkit.suite.staleness import StalenessChecks

VOCAB = 512


def ngram_subject(logprobs_mode: str, backend_cls=NgramGeneration):
    config = conformance_config(
        backend="ngram", model_name="ngram", vocab_size=VOCAB, logprobs_mode=logprobs_mode
    )
    backend = backend_cls(config)
    return ConformanceSubject(backend, VOCAB, backend.state_dict())


class TestNgramRaw(GenerationConformanceSuite):
    claims_weight_updates = True
    claims_score = True

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls):
        subject = ngram_subject("raw")
        yield subject
        subject.backend.shutdown()


class TestNgramProcessed(TestNgramRaw):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls):
        subject = ngram_subject("processed")
        yield subject
        subject.backend.shutdown()


class TestNgramStaleness(StalenessChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls):
        subject = ngram_subject("raw")
        yield subject
        subject.backend.shutdown()
