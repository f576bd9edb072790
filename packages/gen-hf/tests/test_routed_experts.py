"""``return_routed_experts``: gen-hf's routing of every position it read equals transformers' own
router choice on the same tokens (one pass, no cache), from ``generate``, ``generate_async`` and
``score``; the last generated token, never fed, is -1; a dense model refuses the setting."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
import torch
from gen_hf import HfConfig, HfGeneration
from gen_interface import BatchedDataDict, GenerationConfigError
from gen_testkit.models import TinyModel
from gen_testkit.routing import compare_routing, reference_routing
from gen_testkit.strategies import pad_prompts
from transformers import AutoModelForCausalLM, PreTrainedModel

PROMPTS = [[5, 17, 42, 8], [99, 3], [7, 7, 7, 7, 7, 7], [300, 12, 40, 41, 43]]
TOP_K = 2


@pytest.fixture(scope="module")
def backend(
    tiny_qwen3_moe: TinyModel, make_config: Callable[..., HfConfig]
) -> Iterator[HfGeneration]:
    generation = HfGeneration(
        make_config(tiny_qwen3_moe, return_routed_experts=True, max_new_tokens=10)
    )
    yield generation
    generation.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_qwen3_moe: TinyModel) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_moe.path), dtype=torch.float32)


def _rows(out: BatchedDataDict, read: Callable[[int], int]) -> list[torch.Tensor]:
    """Each row's routing over the positions ``read(row)`` says the model read."""
    return [out["routed_experts"][i, : read(i)] for i in range(out["routed_experts"].shape[0])]


@pytest.mark.parametrize("greedy", [True, False])
def test_generated_rows_route_as_the_model_does(
    backend: HfGeneration, reference: PreTrainedModel, greedy: bool
):
    out = backend.generate(pad_prompts(PROMPTS, "left"), greedy=greedy)
    routed = out["routed_experts"]
    assert routed.dtype == torch.int16 and tuple(routed.shape[2:]) == (2, TOP_K)
    totals = out["unpadded_sequence_lengths"].tolist()
    got = _rows(out, lambda i: totals[i] - 1)
    refs = [
        reference_routing(reference, out["output_ids"][i, :n].tolist(), TOP_K)
        for i, n in enumerate(totals)
    ]
    result = compare_routing(got, refs)
    assert result.compared == 2 * sum(n - 1 for n in totals)
    # One implementation (transformers' routers) on both sides: every pair agrees exactly.
    assert result.equal == result.compared, result.mismatches
    for i, n in enumerate(totals):  # the last token was sampled, never read; padding after it
        assert (routed[i, n - 1 :] == -1).all()
        assert (routed[i, : n - 1] >= 0).all() and (routed[i, : n - 1] < 8).all()


def test_each_async_row_carries_the_routing_generate_gives(backend: HfGeneration):
    data = pad_prompts(PROMPTS, "left")
    whole = backend.generate(data, greedy=True)

    async def rows() -> dict[int, BatchedDataDict]:
        return {i: row async for i, row in backend.generate_async(data, greedy=True)}

    for i, row in asyncio.run(rows()).items():
        n = int(row["unpadded_sequence_lengths"][0])
        assert torch.equal(row["routed_experts"][0], whole["routed_experts"][i, :n])


def test_score_routes_every_position_of_the_sequence(
    backend: HfGeneration, reference: PreTrainedModel
):
    sequences = [[*p, 11, 12, 13] for p in PROMPTS]
    width = max(map(len, sequences))
    ids = torch.zeros((len(sequences), width), dtype=torch.int64)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    out = backend.score_top_logprobs(
        BatchedDataDict(
            input_ids=ids,
            prompt_lengths=torch.tensor([len(p) for p in PROMPTS]),
            unpadded_sequence_lengths=torch.tensor([len(s) for s in sequences]),
        ),
        0,
    )
    got = _rows(out, lambda i: len(sequences[i]))
    result = compare_routing(got, [reference_routing(reference, s, TOP_K) for s in sequences])
    assert result.compared == 2 * sum(map(len, sequences))
    assert result.equal == result.compared, result.mismatches
    for i, s in enumerate(sequences):
        assert (out["routed_experts"][i, len(s) :] == -1).all()


def test_off_by_default_and_refused_on_a_dense_model(
    tiny_qwen3_moe: TinyModel, tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    plain = HfGeneration(make_config(tiny_qwen3_moe))
    try:
        out = plain.generate(pad_prompts(PROMPTS[:1], "right"), greedy=True)
        assert "routed_experts" not in out
    finally:
        plain.shutdown()
    with pytest.raises(GenerationConfigError, match=r"no MoE router.*set it to false"):
        HfGeneration(make_config(tiny_qwen2, return_routed_experts=True))
