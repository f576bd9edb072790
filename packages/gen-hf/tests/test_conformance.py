"""The testkit's conformance suite against HfGeneration on the tiny Qwen2 and Llama models."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import pytest
from gen_hf import HfConfig, HfGeneration
from gen_testkit.conformance import (
    ConformanceSubject,
    GenerationConformanceSuite,
    conformance_config,
)
from gen_testkit.models import TinyModel


def hf_subject(model: TinyModel, logprobs_mode: str) -> ConformanceSubject:
    config = conformance_config(
        backend="hf",
        model_name=str(model.path),
        vocab_size=model.vocab_size,
        logprobs_mode=logprobs_mode,
        hf_cfg={"device": "cpu"},
    )
    return ConformanceSubject(
        HfGeneration(cast(HfConfig, config)), model.vocab_size, model.state_dict()
    )


class TestHfQwen2Raw(GenerationConformanceSuite):
    claims_score = True
    claims_weight_updates = True

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, tiny_qwen2: TinyModel) -> Iterator[ConformanceSubject]:
        subject = hf_subject(tiny_qwen2, "raw")
        yield subject
        subject.backend.shutdown()


class TestHfQwen2Processed(TestHfQwen2Raw):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, tiny_qwen2: TinyModel) -> Iterator[ConformanceSubject]:
        subject = hf_subject(tiny_qwen2, "processed")
        yield subject
        subject.backend.shutdown()


class TestHfLlamaProcessed(TestHfQwen2Raw):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, tiny_llama: TinyModel) -> Iterator[ConformanceSubject]:
        subject = hf_subject(tiny_llama, "processed")
        yield subject
        subject.backend.shutdown()


class TestHfLlamaRaw(TestHfQwen2Raw):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, tiny_llama: TinyModel) -> Iterator[ConformanceSubject]:
        subject = hf_subject(tiny_llama, "raw")
        yield subject
        subject.backend.shutdown()


class TestHfTiedEmbeddings(TestHfQwen2Raw):
    """lm_head tied to the embeddings: updates carry the one matrix under its one name."""

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, tiny_qwen2_tied: TinyModel) -> Iterator[ConformanceSubject]:
        subject = hf_subject(tiny_qwen2_tied, "raw")
        yield subject
        subject.backend.shutdown()
