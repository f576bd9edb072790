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


def ngram_subject(logprobs_mode: str):
    """A class's subject: an n-gram backend in ``logprobs_mode``, shut down after the class."""
    config = conformance_config(
        backend="ngram", model_name="ngram", vocab_size=VOCAB, logprobs_mode=logprobs_mode
    )
    backend = NgramGeneration(config)
    yield ConformanceSubject(backend, VOCAB, backend.state_dict())
    backend.shutdown()


class TestNgramRaw(GenerationConformanceSuite):
    claims_weight_updates = True
    claims_score = True

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls):
        yield from ngram_subject("raw")


class TestNgramProcessed(TestNgramRaw):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls):
        yield from ngram_subject("processed")


class TestNgramStaleness(StalenessChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls):
        yield from ngram_subject("raw")
