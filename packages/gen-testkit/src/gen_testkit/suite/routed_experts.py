"""``return_routed_experts: true``: every position a backend read routes as transformers' own
routers route the same tokens.

Not part of the default conformance suite: a backend that offers the capability runs this one on
a subject built with ``return_routed_experts=True`` on an MoE model (the testkit's
``tiny-qwen3-moe``). The reference is ``gen_testkit.routing.reference_routing``: the row's whole
sequence in one pass of the transformers model, no cache, so agreement also proves independence
from batch mates, padding, and the backend's prefill/decode split. A (position, layer) whose
router's k-th and (k+1)-th logits are within ``ROUTER_NEAR_TIE`` may differ (a kernel's rounding
can swap them); anything else fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gen_interface import BatchedDataDict
from hypothesis import given
from hypothesis import strategies as st

from gen_testkit.routing import compare_routing, reference_routing
from gen_testkit.strategies import pad_prompts, prompts, score_batch
from gen_testkit.suite.base import ConformanceSubject, SuiteBase, property_settings

__all__ = ["RoutedExpertsProperties"]


class RoutedExpertsProperties(SuiteBase):
    """Routed experts of generated and scored rows against transformers' routers."""

    @pytest.fixture(scope="class")
    @classmethod
    def reference_model(cls, subject: ConformanceSubject) -> Iterator[torch.nn.Module]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            subject.backend.config["model_name"], dtype=torch.float32
        )
        yield model.eval()

    def _check(
        self,
        reference_model: torch.nn.Module,
        routed: torch.Tensor,
        sequences: list[list[int]],
        read: list[int],
    ) -> None:
        """Row i read its first ``read[i]`` positions: they route as the reference does; the
        rest of the row is -1."""
        assert routed.dtype == torch.int16 and routed.dim() == 4
        references = [reference_routing(reference_model, s, routed.shape[3]) for s in sequences]
        result = compare_routing([routed[i, :n] for i, n in enumerate(read)], references)
        assert result.compared == routed.shape[2] * sum(read)
        assert not result.mismatches, result
        for i, n in enumerate(read):
            assert (routed[i, n:] == -1).all(), f"row {i} has routing past position {n}"

    def test_subject_returns_routed_experts(self, subject: ConformanceSubject):
        assert subject.backend.config["return_routed_experts"] is True
        assert subject.backend.capabilities.routed_experts

    @property_settings
    @given(data=st.data())
    def test_generated_rows_route_as_the_model_does(
        self, subject: ConformanceSubject, reference_model: torch.nn.Module, data: st.DataObject
    ):
        rows = data.draw(prompts(subject.vocab_size, max_rows=self.max_rows, max_length=10))
        batch = pad_prompts(rows, data.draw(st.sampled_from(["left", "right", "mixed"])))
        greedy = data.draw(st.booleans())
        out = subject.backend.generate(batch, greedy=greedy)
        totals = out["unpadded_sequence_lengths"].tolist()
        sequences = [out["output_ids"][i, :n].tolist() for i, n in enumerate(totals)]
        # every position but the last generated token (sampled, never fed); a row cut before
        # its first token read nothing
        read = [n - 1 if g else 0 for n, g in zip(totals, out["generation_lengths"].tolist())]
        self._check(reference_model, out["routed_experts"], sequences, read)

    def test_async_rows_carry_the_routing_generate_gives(self, subject: ConformanceSubject):
        batch = pad_prompts([[5, 17, 42, 8], [99, 3], [7] * 9], "left")
        whole = subject.backend.generate(batch, greedy=True)

        async def rows() -> dict[int, BatchedDataDict[Any]]:
            return {i: row async for i, row in subject.backend.generate_async(batch, greedy=True)}

        for i, row in asyncio.run(rows()).items():
            n = int(row["unpadded_sequence_lengths"][0])
            assert torch.equal(row["routed_experts"][0], whole["routed_experts"][i, :n])

    @property_settings
    @given(data=st.data())
    def test_scored_sequences_route_every_position(
        self, subject: ConformanceSubject, reference_model: torch.nn.Module, data: st.DataObject
    ):
        if not self.claims_score:
            pytest.skip("the subject does not claim score")
        sequences = data.draw(
            prompts(subject.vocab_size, max_rows=self.max_rows, min_length=2, max_length=14)
        )
        starts = [data.draw(st.integers(1, len(s) - 1)) for s in sequences]
        out = subject.backend.score_top_logprobs(score_batch(sequences, starts), 0)
        lengths = [len(s) for s in sequences]
        self._check(reference_model, out["routed_experts"], sequences, lengths)
