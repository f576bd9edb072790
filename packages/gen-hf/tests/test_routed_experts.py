"""``return_routed_experts`` on gen-hf: the testkit's routing properties on the tiny MoE
(forward hooks on transformers' routers, so every pair agrees exactly), and the setting off by
default and refused on a dense model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import cast

import pytest
from gen_hf import HfConfig, HfGeneration
from gen_interface import GenerationConfigError
from gen_testkit.conformance import ConformanceSubject, conformance_config
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts
from gen_testkit.suite.routed_experts import RoutedExpertsProperties


class TestQwen3Moe(RoutedExpertsProperties):
    claims_score = True

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, tiny_qwen3_moe: TinyModel) -> Iterator[ConformanceSubject]:
        config = conformance_config(
            backend="hf",
            model_name=str(tiny_qwen3_moe.path),
            vocab_size=tiny_qwen3_moe.vocab_size,
            return_routed_experts=True,
            hf_cfg={"device": "cpu"},
        )
        subject = ConformanceSubject.for_model(HfGeneration(cast(HfConfig, config)), tiny_qwen3_moe)
        yield subject
        subject.backend.shutdown()


def test_off_by_default_and_refused_on_a_dense_model(
    tiny_qwen3_moe: TinyModel, tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    plain = HfGeneration(make_config(tiny_qwen3_moe))
    try:
        out = plain.generate(pad_prompts([[5, 17, 42]], "right"), greedy=True)
        assert "routed_experts" not in out and not plain.routing
    finally:
        plain.shutdown()
    with pytest.raises(GenerationConfigError, match=r"no MoE router.*set it to false"):
        HfGeneration(make_config(tiny_qwen2, return_routed_experts=True))
