"""The token path without engines: ``StepFeed`` hands the driver every step's output once, in
order, one message per take; the router hands each call its own rows' tokens and results from
the replicas' streams, a row's tokens before its result, and fails a call whose replica dies."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fake_replicas import FakeReplicas
from gen_interface import GenerationError
from gen_vllm.messages import RowFailure, RowOutput, RowRequest, TokenDelta
from gen_vllm.router import RowRouter
from gen_vllm.step_feed import StepFeed


def test_the_feed_hands_over_every_step_once_in_order_across_threads():
    feed = StepFeed()
    pushed = 200

    def engine_thread() -> None:
        for i in range(pushed):
            feed.push([TokenDelta(f"r{i % 3}", [i], [-1.0], [], [])])
        feed.push(finished=[("r0", RowOutput(finish_reason="stop"))])
        feed.close()

    async def read() -> tuple[list[int], int, int]:
        seen: list[int] = []
        takes = finished = 0
        thread = threading.Thread(target=engine_thread)
        thread.start()
        while (batch := await feed.take()) is not None:
            takes += 1
            seen.extend(t for delta in batch.deltas for t in delta.token_ids)
            finished += len(batch.finished)
        thread.join()
        return seen, takes, finished

    seen, takes, finished = asyncio.run(read())
    assert seen == list(range(pushed)) and finished == 1
    assert takes <= pushed + 1  # steps pushed while the reader was busy come in one message


def test_the_feed_keeps_failures_and_says_when_it_ends():
    feed = StepFeed()
    feed.push(failed=[RowFailure("r1", "the row failed", engine_failed=True)])
    feed.close()

    async def read() -> list[object]:
        return [await feed.take(), await feed.take()]

    first, second = asyncio.run(read())
    assert first is not None and first.failed[0].engine_failed and second is None


def _requests(call: str, count: int, *, stream: bool) -> list[RowRequest]:
    return [RowRequest(f"{call}-{i}", [1, 2], {"max_tokens": 4}, stream) for i in range(count)]


def test_each_call_gets_its_own_rows_tokens_before_their_results_in_one_batch_per_step():
    replicas = FakeReplicas(1)
    router = RowRouter(replicas, capacity=8)  # type: ignore[arg-type]

    async def two_calls() -> tuple[list[list[object]], list[list[object]]]:
        a = _requests("a", 2, stream=True)
        b = _requests("b", 1, stream=False)
        got_a: list[list[object]] = []
        got_b: list[list[object]] = []

        async def run(requests: list[RowRequest], into: list[list[object]]) -> None:
            async for batch in router.run(
                requests, [4] * len(requests), 5.0, asyncio.get_running_loop()
            ):
                into.append([(i, type(step).__name__) for i, step in batch.items])

        tasks = [asyncio.ensure_future(run(a, got_a)), asyncio.ensure_future(run(b, got_b))]
        while len(replicas.running[0]) < 3:
            await asyncio.sleep(0.01)
        replicas.emit(0, tokens={"a-0": [5], "a-1": [6], "b-0": [9]})
        replicas.emit(0, tokens={"a-1": [8]}, finished=["a-0", "b-0"])
        replicas.emit(0, finished=["a-1"])
        await asyncio.gather(*tasks)
        return got_a, got_b

    got_a, got_b = asyncio.run(two_calls())
    assert got_a == [
        [(0, "TokenDelta"), (1, "TokenDelta")],
        [(1, "TokenDelta"), (0, "RowOutput")],
        [(1, "RowOutput")],
    ]
    assert got_b == [[(0, "RowOutput")]], "a row that does not stream gets no tokens"
    assert replicas.add_calls == 2, "one call to add each call's rows"


def test_rows_of_a_replica_that_dies_fail_their_call_with_a_generation_error():
    replicas = FakeReplicas(2)
    router = RowRouter(replicas, capacity=8)  # type: ignore[arg-type]

    async def call() -> None:
        task = asyncio.ensure_future(_drain(router))
        while sum(len(r) for r in replicas.running) < 2:
            await asyncio.sleep(0.01)
        replicas.die(1)
        with pytest.raises(GenerationError, match="worker"):
            await task

    asyncio.run(call())
    assert router.rows == [0, 0]
    assert replicas.aborted == ["c-0"], "the row still running elsewhere is aborted"


async def _drain(router: RowRouter) -> None:
    async for _ in router.run(
        _requests("c", 2, stream=False), [4, 4], 5.0, asyncio.get_running_loop()
    ):
        pass


def test_a_call_on_another_threads_loop_gets_its_items_from_the_drivers_loop():
    """The router lives on the driver's loop; a caller iterates on its own: items cross once."""
    from gen_vllm.background_loop import BackgroundLoop

    driver = BackgroundLoop(name="test-driver")
    replicas = FakeReplicas(1)
    router = RowRouter(replicas, capacity=8)  # type: ignore[arg-type]

    async def caller() -> list[list[tuple[int, str]]]:
        got: list[list[tuple[int, str]]] = []

        async def emit_when_running() -> None:
            while len(replicas.running[0]) < 2:
                await asyncio.sleep(0.01)
            replicas.emit(0, tokens={"x-0": [4], "x-1": [5]})
            replicas.emit(0, finished=["x-0", "x-1"])

        feeding = asyncio.run_coroutine_threadsafe(emit_when_running(), driver.loop)
        async for batch in router.run(_requests("x", 2, stream=True), [4, 4], 5.0, driver.loop):
            got.append([(i, type(step).__name__) for i, step in batch.items])
        feeding.result(5)
        return got

    try:
        got = asyncio.run(caller())
    finally:
        driver.close(timeout_s=1)
    assert got == [[(0, "TokenDelta"), (1, "TokenDelta")], [(0, "RowOutput"), (1, "RowOutput")]]
    assert router.rows == [0]
