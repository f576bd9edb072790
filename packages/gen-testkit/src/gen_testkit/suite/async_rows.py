"""Rows streamed by ``generate_async`` (``capabilities.async_generation``), on any backend.

Short rows come back before long ones; many concurrent calls from one event loop each get every
row exactly once, in bounded memory; closing a stream early leaves the backend usable; streamed
rows are the rows ``generate`` returns. Not part of ``GenerationConformanceSuite`` (a few hundred
rows per test): subclass it once per backend with a ``subject`` fixture.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from typing import Any

import pytest
import torch
from gen_interface import GenerationInterface, RowEvent

from gen_testkit.strategies import pad_prompts
from gen_testkit.suite.base import ConformanceSubject

__all__ = ["AsyncRowChecks"]

PROMPTS = [[5, 17, 42, 8], [99, 3], [7, 7, 7], [11, 12, 13, 14, 15]]


class AsyncRowChecks:
    """``concurrent_calls`` calls of ``rows_per_call`` rows each run at once in one test."""

    concurrent_calls = 50
    rows_per_call = 4
    #: Python-heap bounds (``tracemalloc``) on the concurrent run: at its peak, per row in
    #: flight, and what is still held once every row was returned and dropped. Measured on
    #: 200 rows of the tiny models: 6 KiB (gen-hf) and 13 KiB (gen-vllm) per row at the peak,
    #: 106 KiB and 63 KiB left (gen-hf: 125 KiB after 600 rows, so it does not grow with them).
    peak_bytes_per_row = 32 * 1024
    bytes_left_behind = 256 * 1024

    @pytest.fixture(scope="class")
    @classmethod
    def streaming(cls, subject: ConformanceSubject) -> GenerationInterface:
        if not subject.backend.capabilities.async_generation:
            pytest.skip("backend does not stream rows")
        return subject.backend

    def test_streamed_rows_are_the_rows_generate_returns(
        self, streaming: GenerationInterface
    ) -> None:
        view = streaming.with_sampling(max_new_tokens=12, stop_token_ids=[], seed=3)
        batch = pad_prompts(PROMPTS, "left")
        for greedy in (True, False):
            expected = view.generate(batch, greedy=greedy)
            rows = asyncio.run(_collect(view, batch, greedy))
            assert sorted(i for i, _ in rows) == list(range(len(PROMPTS)))
            for i, row in rows:
                width = int(expected["unpadded_sequence_lengths"][i])
                assert torch.equal(row["output_ids"][0], expected["output_ids"][i, :width])
                assert torch.equal(row["logprobs"][0], expected["logprobs"][i, :width])

    def test_streamed_tokens_make_up_the_rows_generate_returns(
        self, streaming: GenerationInterface
    ) -> None:
        """Each row's events carry its tokens once, in order, and end with its output; the
        last event holds the row's last token (a server sends the finish with it)."""
        view = streaming.with_sampling(max_new_tokens=12, stop_token_ids=[], seed=5)
        batch = pad_prompts(PROMPTS, "left")
        batch["top_logprobs"] = torch.tensor([0, 2, 1, 3])
        for greedy in (True, False):
            expected = view.generate(batch, greedy=greedy)
            events = asyncio.run(_events(view, batch, greedy))
            for i, prompt in enumerate(PROMPTS):
                mine = [e for e in events if e.index == i]
                assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
                start, g = len(prompt), int(expected["generation_lengths"][i])
                tokens = [t for e in mine for t in e.token_ids]
                assert tokens == expected["output_ids"][i, start : start + g].tolist()
                logprobs = torch.tensor([lp for e in mine for lp in e.logprobs])
                assert torch.equal(logprobs, expected["logprobs"][i, start : start + g])
                top = [ids for e in mine for ids in e.topk_ids]
                k = int(batch["top_logprobs"][i])
                assert top == expected["topk_ids"][i, start : start + g, :k].tolist()
                final = mine[-1].output
                assert final is not None
                assert mine[-1].token_ids[-1:] == tokens[-1:], "the last token came before"
                assert torch.equal(final["output_ids"][0], expected["output_ids"][i, : start + g])

    def test_tokens_arrive_before_their_row_ends(self, streaming: GenerationInterface) -> None:
        """With ``capabilities.token_streaming``, a long row sends its tokens as they come."""
        if not streaming.capabilities.token_streaming:
            pytest.skip("backend streams whole rows")
        view = streaming.with_sampling(max_new_tokens=48, stop_token_ids=[])
        events = asyncio.run(_events(view, pad_prompts(PROMPTS[:1], "left"), True))
        assert len(events) > 8, f"48 tokens came in {len(events)} events"
        assert len(events[0].token_ids) < 48

    def test_short_rows_arrive_before_long_ones(self, streaming: GenerationInterface) -> None:
        long = 96
        view = streaming.with_sampling(max_new_tokens=long, stop_token_ids=[])
        # A stop token that the row of PROMPTS[1] emits first: that row ends after one token.
        alone = view.generate(pad_prompts([PROMPTS[1]], "left"), greedy=True)
        stopper = view.with_sampling(stop_token_ids=[int(alone["output_ids"][0, 2])])
        batch = pad_prompts(PROMPTS, "left")
        lengths = stopper.generate(batch, greedy=True)["generation_lengths"].tolist()
        short = sorted(i for i, n in enumerate(lengths) if n < long // 4)
        assert short and len(short) < len(PROMPTS), lengths
        order = [i for i, _ in asyncio.run(_collect(stopper, batch, True))]
        assert sorted(order[: len(short)]) == short, (order, lengths)

    def test_many_concurrent_calls_from_one_event_loop_each_get_every_row_once(
        self, streaming: GenerationInterface
    ) -> None:
        view = streaming.with_sampling(max_new_tokens=6, stop_token_ids=[], seed=1)
        batches = [
            pad_prompts([[(c * 7 + r) % 200 + 3, 5] for r in range(self.rows_per_call)], "left")
            for c in range(self.concurrent_calls)
        ]

        async def run_all() -> list[list[tuple[int, Any]]]:
            return list(await asyncio.gather(*(_collect(view, b, False) for b in batches)))

        results = asyncio.run(run_all())
        for call, rows in enumerate(results):
            assert sorted(i for i, _ in rows) == list(range(self.rows_per_call)), call
            for i, row in rows:
                prompt = batches[call]["input_ids"][i][-2:]
                assert torch.equal(row["output_ids"][0, :2], prompt), (call, i)
                assert int(row["generation_lengths"][0]) == 6
        del results
        # Memory: the same workload again, traced. What this process holds at the peak is
        # bounded per row, and nothing is left behind once the rows are returned and dropped.
        total = self.concurrent_calls * self.rows_per_call
        peak, left = _traced(lambda: asyncio.run(run_all()))
        assert peak < total * self.peak_bytes_per_row, f"peak {peak} B for {total} rows"
        assert left < self.bytes_left_behind, f"{left} B still held after the calls"

    def test_closing_a_stream_early_leaves_the_backend_usable(
        self, streaming: GenerationInterface
    ) -> None:
        view = streaming.with_sampling(max_new_tokens=200, stop_token_ids=[])
        batch = pad_prompts(PROMPTS, "left")

        async def first_row_then_close() -> int:
            stream = view.generate_async(batch, greedy=True)
            index, _row = await stream.__anext__()
            await stream.aclose()
            return int(index)

        assert asyncio.run(first_row_then_close()) in range(len(PROMPTS))
        again = view.with_sampling(max_new_tokens=3).generate(batch, greedy=True)
        assert again["generation_lengths"].tolist() == [3] * len(PROMPTS)


def _traced(run: Any) -> tuple[int, int]:
    """``(peak, left)``: bytes of Python heap ``run()`` held at its peak, and still holds after
    it returned and its result was dropped, both above what was held before it."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        run()
        peak = tracemalloc.get_traced_memory()[1] - base
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return peak, left


async def _events(view: GenerationInterface, batch: Any, greedy: bool) -> list[RowEvent]:
    return [event async for event in view.generate_stream(batch, greedy)]


async def _collect(view: GenerationInterface, batch: Any, greedy: bool) -> list[tuple[int, Any]]:
    return [item async for item in view.generate_async(batch, greedy)]
