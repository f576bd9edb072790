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
        return ConformanceSubject(backend, tiny_qwen2.vocab_size, tiny_qwen2.state_dict())


class TestTwoReplicas(TestOneReplica):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, engines, tiny_qwen2):
        backend = engines.get(tiny_qwen2, replicas=2)
        assert backend.num_replicas == 2
        return ConformanceSubject(backend, tiny_qwen2.vocab_size, tiny_qwen2.state_dict())


class TestProcessedLogprobs(TestOneReplica):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, engines, tiny_llama):
        backend = engines.get(tiny_llama, replicas=1, logprobs_mode="processed")
        return ConformanceSubject(backend, tiny_llama.vocab_size, tiny_llama.state_dict())


class TestTiedEmbeddings(TestOneReplica):
    """lm_head tied to the embeddings, as in most small RL models."""

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, engines, tiny_qwen2_tied):
        backend = engines.get(tiny_qwen2_tied, replicas=1)
        return ConformanceSubject(backend, tiny_qwen2_tied.vocab_size, tiny_qwen2_tied.state_dict())
