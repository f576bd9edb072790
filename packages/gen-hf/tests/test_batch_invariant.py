"""``batch_invariant: true`` on gen-hf: the testkit's bitwise properties, float32 and bfloat16,
and what the setting changes and refuses."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, cast

import pytest
import torch
from gen_hf import HfConfig, HfGeneration
from gen_hf.exact import ATTENTION_NAME
from gen_interface import GenerationConfigError
from gen_testkit.conformance import ConformanceSubject, conformance_config
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts
from gen_testkit.suite.batch_invariance import BatchInvarianceProperties, trainer_logprobs

PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7, 7, 7, 7], [300, 12]]


def invariant_subject(model: TinyModel, dtype: str) -> ConformanceSubject:
    config = conformance_config(
        backend="hf",
        model_name=str(model.path),
        vocab_size=model.vocab_size,
        dtype=dtype,
        batch_invariant=True,
        hf_cfg={"device": "cpu"},
    )
    return ConformanceSubject.for_model(HfGeneration(cast(HfConfig, config)), model)


class TestQwen2Float32(BatchInvarianceProperties):
    """The properties on one of the testkit's models (the fixture named ``model``)."""

    claims_score = True
    dtype = "float32"
    model: ClassVar[str] = "tiny_qwen2"

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, request: pytest.FixtureRequest) -> Iterator[ConformanceSubject]:
        subject = invariant_subject(request.getfixturevalue(cls.model), cls.dtype)
        yield subject
        subject.backend.shutdown()


class TestQwen2Bfloat16(TestQwen2Float32):
    dtype = "bfloat16"


class TestLlamaFloat32(TestQwen2Float32):
    model = "tiny_llama"


class TestLlamaBfloat16(TestLlamaFloat32):
    dtype = "bfloat16"


class TestTiedEmbeddingsFloat32(TestQwen2Float32):
    """lm_head tied to the embeddings: the head's one matrix runs through the exact linear."""

    model = "tiny_qwen2_tied"


def test_without_the_setting_the_model_keeps_its_own_kernels_and_differs_from_exact(
    make_config, tiny_qwen2
):
    """The default changes nothing, and the properties above are not vacuous: transformers' own
    kernels give a row other bits than the exact forward."""
    backend = HfGeneration(make_config(tiny_qwen2, max_new_tokens=12))
    try:
        model = backend._model().model
        assert model.config._attn_implementation == "eager"
        assert not any("forward" in vars(m) for m in model.modules())
        assert not backend.config.get("batch_invariant")
        out = backend.generate(pad_prompts(PROMPTS * 4, "left"), greedy=True)
        trainer = type(model).from_pretrained(str(tiny_qwen2.path), dtype=torch.float32)
        sequences = [
            out["output_ids"][i, : int(out["unpadded_sequence_lengths"][i])].tolist()
            for i in range(len(PROMPTS))
        ]
        exact = trainer_logprobs(trainer.eval(), sequences, padding="right")
        equal = sum(
            int((out["logprobs"][i, len(p) : len(s)] == exact[i][len(p) :]).sum())
            for i, (p, s) in enumerate(zip(PROMPTS, sequences))
        )
        compared = sum(len(s) - len(p) for p, s in zip(PROMPTS, sequences))
        assert equal < compared
    finally:
        backend.shutdown()


def test_the_setting_switches_the_model_to_the_exact_kernels(tiny_qwen2):
    backend = invariant_subject(tiny_qwen2, "float32").backend
    try:
        model = backend._model().model
        assert model.config._attn_implementation == ATTENTION_NAME
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all("forward" in vars(m) for m in linears)
    finally:
        backend.shutdown()


def test_batch_invariant_must_be_a_bool(make_config, tiny_qwen2):
    with pytest.raises(GenerationConfigError, match="`batch_invariant` must be a bool"):
        HfGeneration(make_config(tiny_qwen2, batch_invariant="yes"))
