"""The testkit's conformance suite against vLLM on CPU: one replica, two replicas, both
logprob modes."""

import pytest
from gen_testkit.conformance import ConformanceSubject, GenerationConformanceSuite


class TestOneReplica(GenerationConformanceSuite):
    claims_score = True
    claims_weight_updates = True

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, engines, tiny_qwen2):
        backend = engines.get(tiny_qwen2, replicas=1)
        return ConformanceSubject.for_model(backend, tiny_qwen2)


class TestTwoReplicas(TestOneReplica):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, engines, tiny_qwen2):
        backend = engines.get(tiny_qwen2, replicas=2)
        assert backend.num_replicas == 2
        return ConformanceSubject.for_model(backend, tiny_qwen2)


class TestProcessedLogprobs(TestOneReplica):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, engines, tiny_llama):
        backend = engines.get(tiny_llama, replicas=1, logprobs_mode="processed")
        return ConformanceSubject.for_model(backend, tiny_llama)


class TestTiedEmbeddings(TestOneReplica):
    """lm_head tied to the embeddings, as in most small RL models."""

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, engines, tiny_qwen2_tied):
        backend = engines.get(tiny_qwen2_tied, replicas=1)
        return ConformanceSubject.for_model(backend, tiny_qwen2_tied)
