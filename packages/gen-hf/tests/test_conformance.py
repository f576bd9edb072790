"""The testkit's conformance suite against HfGeneration on the tiny Qwen2 and Llama models."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import cast

import pytest
import torch
from gen_hf import HfConfig, HfGeneration
from gen_testkit.conformance import (
    ConformanceSubject,
    GenerationConformanceSuite,
    conformance_config,
)
from gen_testkit.models import TinyModel
from gen_testkit.suite.deltas import WeightDeltaProperties


def hf_subject(model: TinyModel, logprobs_mode: str, dtype: str = "float32") -> ConformanceSubject:
    config = conformance_config(
        backend="hf",
        model_name=str(model.path),
        vocab_size=model.vocab_size,
        logprobs_mode=logprobs_mode,
        hf_cfg={"device": "cpu"},
        dtype=dtype,
    )
    backend = HfGeneration(cast(HfConfig, config))
    return ConformanceSubject.for_model(backend, model, fail_rows=_forward_failure(backend))


def _forward_failure(backend: HfGeneration) -> Callable[[bool], None]:
    """``fail_rows``: while on, every forward pass of the model raises, as a failing kernel
    would."""
    hooks: list[torch.utils.hooks.RemovableHandle] = []

    def fail(module: torch.nn.Module, args: object) -> None:
        raise RuntimeError("a kernel failed (the test's forward hook)")

    def fail_rows(on: bool) -> None:
        if on:
            hooks.append(backend._model().model.register_forward_pre_hook(fail))
        else:
            while hooks:
                hooks.pop().remove()

    return fail_rows


class TestHfQwen2Raw(GenerationConformanceSuite):
    claims_score = True
    claims_weight_updates = True
    claims_weight_deltas = True

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


class TestHfDeltasInBfloat16(WeightDeltaProperties):
    """Delta refits of a bfloat16 model from float32 master weights (the refitter casts)."""

    claims_weight_updates = True
    claims_weight_deltas = True

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, tiny_qwen2: TinyModel) -> Iterator[ConformanceSubject]:
        subject = hf_subject(tiny_qwen2, "raw", dtype="bfloat16")
        yield subject
        subject.backend.shutdown()


class TestHfDeltasInFloat16(TestHfDeltasInBfloat16):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, tiny_llama: TinyModel) -> Iterator[ConformanceSubject]:
        subject = hf_subject(tiny_llama, "raw", dtype="float16")
        yield subject
        subject.backend.shutdown()
