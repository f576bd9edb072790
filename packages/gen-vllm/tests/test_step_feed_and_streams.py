"""The token path without engines: ``StepFeed`` hands the driver every step's output once, in
order, one message per take; the router hands each call its own rows' tokens and results from
the replicas' streams, a row's tokens before its result, and fails a call whose replica dies
(fail-stop) or moves its rows (healing)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import pytest
from fake_replicas import FakeReplicas
from gen_backend_kit.fleet_health import FleetHealth
from gen_interface import GenerationError, NoReplicaServingError, RowLostError
from gen_vllm.delivery import DeliveryTimes
from gen_vllm.messages import RowFailure, RowOutput, RowRequest, StepBatch, TokenDelta
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


class _Reader:
    """A reader of ``feed`` on a loop of its own thread that "sends" each batch it takes (holds
    it until ``release`` is set, when given one) and records it as sent."""

    def __init__(self, feed: StepFeed, release: threading.Event | None = None):
        self.feed, self.release, self.sent = feed, release, []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._read()))
        self.thread.start()
        deadline = time.monotonic() + 10
        while feed._waiter is None and time.monotonic() < deadline:  # waits in take
            time.sleep(0.001)

    async def _read(self) -> None:
        while (batch := await self.feed.take()) is not None:
            if self.release is not None:
                self.release.wait(10)
            self.sent.append(batch)


def test_a_push_that_wakes_a_reader_returns_once_the_batch_is_sent():
    feed = StepFeed()
    reader = _Reader(feed)
    feed.push([TokenDelta("r0", [5], [-1.0], [], [])], hand_over_s=10.0)
    assert len(reader.sent) == 1 and reader.sent[0].deltas[0].token_ids == [5]
    feed.close()
    reader.thread.join(10)


def test_a_hand_over_waits_no_longer_than_it_is_given():
    feed = StepFeed()
    release = threading.Event()
    reader = _Reader(feed, release)  # takes the batch, then does not come back
    feed.push([TokenDelta("r0", [5], [-1.0], [], [])], hand_over_s=0.05)
    assert reader.sent == []  # the push gave up waiting: the reader still holds the batch
    feed.push([TokenDelta("r0", [6], [-1.0], [], [])], hand_over_s=10.0)  # no reader waits
    assert reader.sent == []
    release.set()
    feed.close()
    reader.thread.join(10)
    assert [t for b in reader.sent for d in b.deltas for t in d.token_ids] == [5, 6]


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
    assert replicas.add_calls == 1, "both calls, started in one turn, add their rows together"


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


def test_an_engine_that_steps_without_output_sends_a_heartbeat_a_second():
    """A wedged engine sends nothing; one that steps on rows that report only at their end
    sends the step count at least every ``HEARTBEAT_S``, so the driver can tell them apart."""
    from gen_vllm.step_feed import HEARTBEAT_S

    feed = StepFeed()

    async def read() -> tuple[StepBatch | None, float]:
        started = time.monotonic()
        take = asyncio.ensure_future(feed.take())
        while not take.done():
            feed.push(step_seconds=0.01)  # a step that finished no row and streams nothing
            await asyncio.sleep(0.05)
        return take.result(), time.monotonic() - started

    batch, waited = asyncio.run(read())
    assert batch is not None and not batch and batch.steps >= 10
    assert HEARTBEAT_S * 0.9 <= waited < HEARTBEAT_S + 1.0
    feed.close()


def _healing_router(replicas: FakeReplicas, wedge_timeout_s: float = 30.0):
    health = FleetHealth(len(replicas), max_restarts=0)
    lost: list[tuple[int, str]] = []

    def on_lost(replica: int, why: str) -> None:
        lost.append((replica, why))
        health.kill(replica, why)

    router = RowRouter(
        replicas,  # type: ignore[arg-type]
        capacity=8,
        health=health,
        on_lost=on_lost,
        wedge_timeout_s=wedge_timeout_s,
    )
    return router, health, lost


def test_healing_the_rows_of_a_replica_that_dies_run_again_elsewhere():
    replicas = FakeReplicas(2)
    router, health, lost = _healing_router(replicas)

    async def call() -> list[int]:
        done: list[int] = []

        async def drain() -> None:
            async for batch in router.run(
                _requests("h", 4, stream=False), [4] * 4, 5.0, asyncio.get_running_loop()
            ):
                done.extend(i for i, step in batch.items if isinstance(step, RowOutput))

        task = asyncio.ensure_future(drain())
        while sum(len(r) for r in replicas.running) < 4:
            await asyncio.sleep(0.01)
        on_one = sorted(replicas.running[1])
        replicas.die(1)
        while len(replicas.running[0]) < 4:  # replica 1's rows arrive on replica 0
            await asyncio.sleep(0.01)
        assert set(on_one) <= set(replicas.running[0])
        replicas.emit(0, finished=sorted(replicas.running[0]))
        await task
        return done

    assert sorted(asyncio.run(call())) == [0, 1, 2, 3]
    assert [r for r, _ in lost] == [1] and health.serving() == [0]
    assert router.rows_rerun == 2 and router.rows == [0, 0]


def test_healing_a_row_that_streamed_tokens_ends_its_call_with_row_lost_error():
    replicas = FakeReplicas(2)
    router, _, _ = _healing_router(replicas)

    async def call() -> None:
        async def drain() -> None:
            async for _ in router.run(
                _requests("s", 2, stream=True), [4, 4], 5.0, asyncio.get_running_loop()
            ):
                pass

        task = asyncio.ensure_future(drain())
        while sum(len(r) for r in replicas.running) < 2:
            await asyncio.sleep(0.01)
        streamed = next(iter(replicas.running[1]))
        replicas.emit(1, tokens={streamed: [4]})
        await asyncio.sleep(0.05)
        replicas.die(1)
        with pytest.raises(RowLostError, match=r"row\(s\) \[\d\] had already streamed") as caught:
            await task
        assert caught.value.rows == (int(streamed.split("-")[1]),)

    asyncio.run(call())
    assert router.rows_lost == 1


def test_healing_with_no_replica_left_calls_fail_at_once():
    replicas = FakeReplicas(1)
    router, _, _ = _healing_router(replicas)

    async def call() -> float:
        task = asyncio.ensure_future(_drain(router))
        while not replicas.running[0]:
            await asyncio.sleep(0.01)
        replicas.die(0)
        with pytest.raises(NoReplicaServingError, match="no replica of the fleet serves"):
            await task
        started = time.monotonic()
        with pytest.raises(NoReplicaServingError):
            await _drain(router)  # a new call: refused, not queued
        return time.monotonic() - started

    assert asyncio.run(call()) < 1.0


def test_healing_a_replica_that_holds_rows_and_sends_nothing_is_lost_within_the_bound():
    replicas = FakeReplicas(2)
    router, health, lost = _healing_router(replicas, wedge_timeout_s=0.4)

    async def call() -> float:
        task = asyncio.ensure_future(_drain(router))
        while sum(len(r) for r in replicas.running) < 2:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        replicas.emit(0, finished=sorted(replicas.running[0]))  # replica 1 stays silent
        while not lost:
            await asyncio.sleep(0.01)
        detected = time.monotonic() - started
        while not replicas.running[0]:
            await asyncio.sleep(0.01)
        replicas.emit(0, finished=sorted(replicas.running[0]))
        await task
        return detected

    detected = asyncio.run(call())
    assert 0.3 <= detected < 0.4 + 0.5  # the bound, give or take the checks' period
    assert lost[0][0] == 1 and "wedged" in lost[0][1]
    assert health.serving() == [0]


def test_delivery_times_report_percentiles_under_their_point_s_name_and_clear():
    times = DeliveryTimes("step_to_driver")
    assert times.snapshot() == {"step_to_driver_deliveries_total": 0}
    for ms in range(1, 101):
        times.record(ms / 1000)
    times.record(-0.001)  # another process's clock a little behind: counted as no time
    got = times.snapshot()
    assert got["step_to_driver_deliveries_total"] == 101
    assert got["step_to_driver_seconds_p50"] == pytest.approx(0.050)
    assert got["step_to_driver_seconds_p99"] == pytest.approx(0.099)
    assert got["step_to_driver_seconds_mean"] == pytest.approx(5.05 / 101)
    times.clear()
    assert times.snapshot() == {"step_to_driver_deliveries_total": 0}


def test_the_router_times_each_message_with_rows_from_its_step_s_end():
    replicas = FakeReplicas(1)
    router = RowRouter(replicas, capacity=8)  # type: ignore[arg-type]

    async def one_call() -> None:
        requests = _requests("a", 2, stream=True)
        run = router.run(requests, [4, 4], 5.0, asyncio.get_running_loop())
        task = asyncio.ensure_future(_read_all(run))
        while len(replicas.running[0]) < 2:
            await asyncio.sleep(0.01)
        replicas.emit(0, tokens={"a-0": [5]}, ended=time.time() - 0.5)  # half a second ago
        replicas.emit(0, ended=time.time() - 9.0)  # steps with nothing for the call: not timed
        replicas.emit(0, finished=["a-0", "a-1"], ended=time.time() - 0.25)
        await task

    asyncio.run(one_call())
    got = router.arrivals.snapshot()
    assert got["step_to_driver_deliveries_total"] == 2
    assert 0.25 <= got["step_to_driver_seconds_p50"] <= got["step_to_driver_seconds_p99"] < 9.0
    assert got["step_to_driver_seconds_p99"] >= 0.5


async def _read_all(items: AsyncIterator[object]) -> None:
    async for _ in items:
        pass
