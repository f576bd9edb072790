"""Token streaming on the driver and the worker, without engines: ``TokenFeed`` hands over every
pushed delta once, in order, and wakes a waiting reader; ``TokenStreams`` gives each call its own
rows' tokens before their results and drops tokens that arrive after their row's result."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
from gen_vllm.messages import RowOutput, RowRequest, TokenDelta
from gen_vllm.token_feed import TokenFeed
from gen_vllm.token_streams import TokenStreams


def _delta(request_id: str, *tokens: int) -> TokenDelta:
    return TokenDelta(request_id, list(tokens), [-0.5] * len(tokens), [], [])


def test_the_feed_hands_over_every_delta_once_in_order_across_threads():
    feed = TokenFeed()

    async def read() -> list[int]:
        got: list[int] = []
        while len(got) < 200:
            got += [t for d in await feed.take(5.0) for t in d.token_ids]
        return got

    def write() -> None:
        for i in range(200):
            feed.push([_delta("r", i)])

    async def both() -> list[int]:
        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0.01)  # the reader waits on an empty feed first
        writer = threading.Thread(target=write)
        writer.start()
        got = await reader
        writer.join()
        return got

    assert asyncio.run(both()) == list(range(200))


def test_an_empty_feed_answers_after_its_timeout():
    assert asyncio.run(TokenFeed().take(0.05)) == []


class _Replicas:
    """One replica whose worker holds a scripted list of polls."""

    def __init__(self, polls: list[list[TokenDelta]]):
        self.polls = polls

    def __len__(self) -> int:
        return 1

    async def token_deltas(self, replica: int, timeout_s: float) -> list[TokenDelta]:
        if self.polls:
            return self.polls.pop(0)
        await asyncio.sleep(timeout_s)
        return []


async def _rows(script: list[tuple[float, int, RowOutput]]) -> AsyncIterator[tuple[int, RowOutput]]:
    for delay, index, output in script:
        await asyncio.sleep(delay)
        yield index, output


def test_tokens_come_before_their_rows_result_and_late_ones_are_dropped():
    requests = [RowRequest(f"c-{i}", [1], {}, stream=True) for i in range(2)]
    # Row 0's tokens come in two polls before its result; row 1's result comes before its
    # tokens reach the driver (they are in its result already); a delta of another call's row
    # goes nowhere.
    replicas = _Replicas([[_delta("c-0", 5), _delta("other-0", 9)], [_delta("c-0", 6)]])
    finished_1 = RowOutput(token_ids=[7], logprobs=[-0.1], finish_reason="stop")
    finished_0 = RowOutput(token_ids=[5, 6], logprobs=[-0.5, -0.5], finish_reason="length")

    async def run() -> list[tuple[int, object]]:
        streams = TokenStreams(replicas, poll_s=0.01)  # type: ignore[arg-type]
        rows = _rows([(0.0, 1, finished_1), (0.1, 0, finished_0)])
        late = [_delta("c-1", 7)]

        async def deliver_late() -> None:
            await asyncio.sleep(0.05)
            replicas.polls.append(late)

        extra = asyncio.ensure_future(deliver_late())
        got = [item async for item in streams.run(requests, rows)]
        await extra
        return got

    got = asyncio.run(run())
    kinds = {row: [type(s).__name__ for i, s in got if i == row] for row in (0, 1)}
    assert kinds == {0: ["TokenDelta", "TokenDelta", "RowOutput"], 1: ["RowOutput"]}
    assert [t for i, s in got if isinstance(s, TokenDelta) for t in s.token_ids] == [5, 6]


def test_closing_the_stream_early_closes_the_rows_iterator():
    closed = asyncio.Event()

    async def endless() -> AsyncIterator[tuple[int, RowOutput]]:
        try:
            while True:
                await asyncio.sleep(0.01)
                yield 0, RowOutput(finish_reason="stop")
        finally:
            closed.set()

    async def run() -> None:
        streams = TokenStreams(_Replicas([]), poll_s=0.01)  # type: ignore[arg-type]
        stream = streams.run([RowRequest("x-0", [1], {}, stream=True)], endless())
        await stream.__anext__()
        await stream.aclose()
        await asyncio.wait_for(closed.wait(), 1.0)
        assert not streams._listeners

    asyncio.run(run())


def test_a_failing_rows_iterator_fails_the_stream():
    async def failing() -> AsyncIterator[tuple[int, RowOutput]]:
        raise RuntimeError("worker gone")
        yield  # pragma: no cover

    async def run() -> None:
        streams = TokenStreams(_Replicas([]), poll_s=0.01)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="worker gone"):
            async for _ in streams.run([RowRequest("y-0", [1], {}, stream=True)], failing()):
                pass

    asyncio.run(run())
