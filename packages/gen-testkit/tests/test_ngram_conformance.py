"""The conformance suite against the testkit's own n-gram backend, in both logprob modes."""

import pytest
from gen_testkit.conformance import (
    ConformanceSubject,
    GenerationConformanceSuite,
    conformance_config,
)
from gen_testkit.ngram import NgramGeneration
from gen_testkit.suite.async_rows import AsyncRowChecks
from gen_testkit.suite.in_flight import InFlightUpdateChecks
from gen_testkit.suite.staleness import StalenessChecks

VOCAB = 512


def ngram_subject(logprobs_mode: str, *, backend_cls=NgramGeneration, in_flight: bool = False):
    """A class's subject: an n-gram backend in ``logprobs_mode``, shut down after the class.

    ``in_flight``: long enough a context for the in-flight checks' 400-token rows, and a pause
    before each step, so their updates land while the rows run.
    """
    ngram = {"context_limit": 1024, "seconds_per_step": 0.003} if in_flight else {}
    config = conformance_config(
        backend="ngram",
        model_name="ngram",
        vocab_size=VOCAB,
        logprobs_mode=logprobs_mode,
        ngram=ngram,
    )
    backend = backend_cls(config)

    def fail_rows(on: bool) -> None:
        backend.model.failing = on

    yield ConformanceSubject(backend, VOCAB, backend.state_dict(), fail_rows)
    backend.shutdown()


class TestNgramRaw(GenerationConformanceSuite):
    claims_weight_updates = True
    claims_weight_deltas = True
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


class TestNgramInFlight(InFlightUpdateChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls):
        yield from ngram_subject("raw", in_flight=True)


class TestNgramAsyncRows(AsyncRowChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls):
        yield from ngram_subject("raw")


@pytest.mark.parametrize(
    ("setting", "value", "off"),
    [
        ("batch_invariant", True, False),
        ("lm_head_fp32", True, False),
        ("return_routed_experts", True, False),
        ("lora", {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]}, None),
    ],
)
def test_a_backend_without_a_setting_some_offer_refuses_it_by_name(
    setting: str, value: object, off: object
):
    from gen_interface import GenerationConfigError

    config = conformance_config(
        backend="ngram", model_name="ngram", vocab_size=VOCAB, **{setting: value}
    )
    with pytest.raises(GenerationConfigError, match=f"{setting} is set but NgramGeneration"):
        NgramGeneration(config)
    backend = NgramGeneration(dict(config, **{setting: off}))
    assert not backend.capabilities.batch_invariant
    backend.shutdown()
