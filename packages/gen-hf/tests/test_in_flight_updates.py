"""Weight updates while rows run in the transformers backend, both modes (the testkit's checks),
and rows streamed by ``generate_async`` as the decode loop finishes them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
import torch
from gen_hf import HfConfig, HfGeneration
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts
from gen_testkit.suite.base import ConformanceSubject
from gen_testkit.suite.in_flight import InFlightUpdateChecks


@pytest.fixture(scope="module")
def backend(tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]) -> Iterator[HfGeneration]:
    backend = HfGeneration(make_config(tiny_qwen2, stop_token_ids=[]))
    yield backend
    backend.shutdown()


class TestInFlightUpdates(InFlightUpdateChecks):
    @pytest.fixture(scope="class")
    def subject(self, backend: HfGeneration, tiny_qwen2: TinyModel) -> ConformanceSubject:
        return ConformanceSubject(backend, tiny_qwen2.vocab_size, tiny_qwen2.state_dict())


def test_generate_async_yields_short_rows_before_long_ones(backend: HfGeneration):
    """Rows of one forward group: a row that stops early comes back before the others end."""
    view = backend.with_sampling(max_new_tokens=64, stop_token_ids=[])
    prompts = [[5, 17, 42, 8], [99, 3], [7, 7, 7]]
    # Row 1 stops at the first token it emits; the others run to 64 tokens.
    first = int(view.generate(pad_prompts([prompts[1]], "left"), greedy=True)["output_ids"][0, 2])
    stopper = view.with_sampling(stop_token_ids=[first])
    expected = stopper.generate(pad_prompts(prompts, "left"), greedy=True)

    async def collect() -> list[tuple[int, dict]]:
        return [item async for item in stopper.generate_async(pad_prompts(prompts, "left"), True)]

    rows = asyncio.run(collect())
    lengths = expected["generation_lengths"].tolist()
    short = [i for i, n in enumerate(lengths) if n < 64]
    assert short and sorted(i for i, _ in rows[: len(short)]) == short
    assert sorted(i for i, _ in rows) == list(range(len(prompts)))
    for i, row in rows:
        width = int(expected["unpadded_sequence_lengths"][i])
        assert torch.equal(row["output_ids"][0], expected["output_ids"][i, :width])
        assert torch.equal(row["logprobs"][0], expected["logprobs"][i, :width])


def test_closing_generate_async_early_ends_the_call_and_the_backend_goes_on(
    backend: HfGeneration,
):
    view = backend.with_sampling(max_new_tokens=200, stop_token_ids=[])
    batch = pad_prompts([[5, 17], [99, 3], [7]], "left")

    async def first_row() -> int:
        stream = view.generate_async(batch, greedy=True)
        async for index, _row in stream:
            await stream.aclose()
            return index
        raise AssertionError("no row")

    assert asyncio.run(first_row()) in range(3)
    again = view.with_sampling(max_new_tokens=3).generate(batch, greedy=True)
    assert again["generation_lengths"].tolist() == [3, 3, 3]
