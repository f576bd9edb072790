"""A worker's step stream over a local socket (``gen_vllm.step_socket``): every step in order to
the reader with the secret, nothing to one without it, a clean end when the feed closes, and a
typed error when the worker's end goes away without it (a killed worker)."""

from __future__ import annotations

import asyncio

import pytest
from gen_vllm import wire
from gen_vllm.messages import RowOutput, TokenDelta
from gen_vllm.step_feed import StepFeed
from gen_vllm.step_socket import (
    StepSocketClosedError,
    StepSocketServer,
    read_step_socket,
    supported,
)

pytestmark = pytest.mark.skipif(not supported(), reason="abstract Unix sockets are Linux's")


def _run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_the_reader_gets_every_step_in_order_then_the_clean_end() -> None:
    async def scenario() -> list:
        feed = StepFeed()
        server = StepSocketServer(feed)
        name, secret = await server.open()
        assert await server.open() == (name, secret)  # opened once
        got = []

        async def read() -> None:
            async for message in read_step_socket(name, secret):
                got.append(wire.decode(message))

        reader = asyncio.ensure_future(read())
        for step in range(3):
            feed.push([TokenDelta(f"r-{step}", [step, 7], [-0.5, -1.0], [], [])], step_seconds=0.01)
            await asyncio.sleep(0.05)  # one message per step while the reader keeps up
        row = RowOutput([1, 2], [-0.1, -0.2], "stop", [0, 0]).packed()
        feed.push(finished=[("r-9", row)], step_seconds=0.01)
        await asyncio.sleep(0.05)
        feed.close()
        await reader  # ends: the feed closed, so the stream's clean end came
        server.close()
        return got

    batches = _run(scenario())
    assert [[d.request_id for d in b.deltas] for b in batches[:3]] == [["r-0"], ["r-1"], ["r-2"]]
    assert [d.token_ids for b in batches[:3] for d in b.deltas] == [[0, 7], [1, 7], [2, 7]]
    assert batches[3].finished[0][0] == "r-9"
    assert batches[3].finished[0][1].unpacked().token_ids == [1, 2]
    assert len(batches) == 4


def test_a_reader_without_the_secret_gets_nothing_and_the_stream_stays_for_the_driver() -> None:
    async def scenario() -> tuple[BaseException | None, list]:
        feed = StepFeed()
        server = StepSocketServer(feed)
        name, secret = await server.open()
        feed.push([TokenDelta("r-0", [5], [-0.5], [], [])], step_seconds=0.01)
        error: BaseException | None = None
        try:
            async for _ in read_step_socket(name, bytes(len(secret))):
                pass
        except StepSocketClosedError as exc:
            error = exc
        got = []

        async def read() -> None:
            async for message in read_step_socket(name, secret):
                got.append(wire.decode(message))

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0.1)
        feed.close()
        await reader
        server.close()
        return error, got

    error, got = _run(scenario())
    assert isinstance(error, StepSocketClosedError)
    # the step pushed before either connected went to the reader with the secret, untouched
    assert [d.token_ids for b in got for d in b.deltas] == [[5]]


def test_a_worker_end_that_closes_without_the_end_is_a_typed_error() -> None:
    async def scenario() -> BaseException | None:
        feed = StepFeed()
        server = StepSocketServer(feed)
        name, secret = await server.open()
        got = []

        async def read() -> None:
            async for message in read_step_socket(name, secret):
                got.append(message)

        reader = asyncio.ensure_future(read())
        feed.push([TokenDelta("r-0", [5], [-0.5], [], [])], step_seconds=0.01)
        await asyncio.sleep(0.1)
        assert len(got) == 1
        server._sender.cancel()  # the worker's sender gone, as with a killed process
        server.close()
        try:
            await reader
        except StepSocketClosedError as exc:
            return exc
        return None

    assert isinstance(_run(scenario()), StepSocketClosedError)


def test_a_name_nobody_serves_is_a_typed_error() -> None:
    async def scenario() -> None:
        async for _ in read_step_socket("\0gen-vllm-steps-nobody", b"x" * 32):
            pass

    with pytest.raises(StepSocketClosedError, match="cannot be reached"):
        _run(scenario())
