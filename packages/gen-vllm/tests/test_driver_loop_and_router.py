"""The driver's event loop and the row router, on stubs: waits are bounded, an interrupted wait
cleans up, and every way of running out of time is the interface's ``GenerationError``."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fake_replicas import FakeReplicas
from gen_interface import GenerationError
from gen_vllm.background_loop import BackgroundLoop
from gen_vllm.messages import RowRequest
from gen_vllm.router import AFFINITY_SLACK_TOKENS, RowRouter
from interrupts import ctrl_c_while_waiting_in


@pytest.fixture
def driver_loop():
    loop = BackgroundLoop(name="test-driver")
    yield loop
    loop.close(timeout_s=1)


def test_an_interrupted_wait_cancels_the_work_so_its_clean_up_runs(driver_loop):
    """Fails on the main before the shared base: Ctrl-C in a synchronous ``generate`` left its
    coroutine (and the rows it was waiting on) running. The Ctrl-C comes once the call waits,
    with Python's handler in place (``interrupts.py``): not after a fixed delay, which a busy
    machine or an inherited SIGINT disposition turned into "DID NOT RAISE"."""
    cleaned = threading.Event()

    async def rows_running() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.set()  # where the router aborts its rows

    with ctrl_c_while_waiting_in(BackgroundLoop.run) as sent, pytest.raises(KeyboardInterrupt):
        driver_loop.run(rows_running())
    assert sent.is_set()
    assert cleaned.wait(5), "the interrupted call's clean-up never ran"


def test_close_is_bounded_even_when_a_task_will_not_stop():
    """Fails on the main before the shared base: ``close`` stopped the loop without cancelling
    its tasks, and a join that timed out made ``loop.close()`` raise."""
    loop = BackgroundLoop(name="test-stubborn")
    cleaned = threading.Event()

    async def polite() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.set()

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                time.sleep(0.05)  # ignores cancellation, as a stuck call would

    asyncio.run_coroutine_threadsafe(polite(), loop._loop)
    asyncio.run_coroutine_threadsafe(stubborn(), loop._loop)
    time.sleep(0.1)
    started = time.monotonic()
    loop.close(timeout_s=0.5)
    assert time.monotonic() - started < 3
    assert cleaned.is_set(), "a cancellable task was not cancelled"
    loop.close(timeout_s=0.5)  # idempotent


def test_a_call_waiting_for_a_free_replica_times_out_with_a_generation_error():
    """Fails on the main before the shared base: ``asyncio.wait_for`` raised a bare
    ``TimeoutError`` when every replica was full of another call's rows."""
    replicas = FakeReplicas(1)
    router = RowRouter(replicas, capacity=1)  # type: ignore[arg-type]

    async def two_calls() -> None:
        first = asyncio.ensure_future(_drain(router, "a", 5.0))
        while not replicas.placed:
            await asyncio.sleep(0.01)
        try:
            with pytest.raises(GenerationError, match=r"did not finish within 0\.2 s"):
                await _drain(router, "b", 0.2)
        finally:
            first.cancel()

    asyncio.run(two_calls())


def test_a_call_whose_rows_run_too_long_times_out_and_aborts_them():
    replicas = FakeReplicas(2)
    router = RowRouter(replicas, capacity=4)  # type: ignore[arg-type]
    with pytest.raises(GenerationError, match=r"\(2 of 2 rows unfinished"):
        asyncio.run(_drain(router, "c", 0.2))
    assert router.rows == [0, 0], "rows of the timed-out call still count as running"
    assert sorted(replicas.aborted) == ["c-0", "c-1"]


async def _drain(router: RowRouter, call: str, timeout_s: float) -> list[int]:
    requests = [RowRequest(f"{call}-{i}", [1, 2], {"max_tokens": 4}) for i in range(2)]
    loop = asyncio.get_running_loop()
    return [i async for d in router.run(requests, [4, 4], timeout_s, loop) for i, _ in d.items]


def _call(router: RowRouter, sessions: list[str | None], cost: int = 4) -> None:
    requests = [
        RowRequest(f"r-{i}", [1, 2], {"max_tokens": cost}, session=s)
        for i, s in enumerate(sessions)
    ]

    async def drain() -> None:
        async for _ in router.run(
            requests, [cost] * len(requests), 5.0, asyncio.get_running_loop()
        ):
            pass

    asyncio.run(drain())


def test_rows_of_a_session_go_to_the_replica_that_served_it():
    replicas = FakeReplicas(2, finish_at_once=True)
    router = RowRouter(replicas, capacity=8)  # type: ignore[arg-type]
    sessions = ["a", "b", "c", "d"]
    _call(router, sessions)
    first = dict(replicas.placed)
    assert sorted(first.values()) == [0, 0, 1, 1]  # spread by load on the first turn
    for _ in range(3):  # later turns, in another order, each with a stranger
        replicas.placed.clear()
        _call(router, ["d", None, "b", "a", "c"])
        placed = dict((s, r) for s, r in replicas.placed if s is not None)
        assert placed == first


def test_a_session_leaves_a_replica_its_load_does_not_allow():
    replicas = FakeReplicas(2, finish_at_once=True)
    router = RowRouter(replicas, capacity=2)  # type: ignore[arg-type]
    _call(router, ["a"])
    home = replicas.placed[0][1]
    replicas.placed.clear()
    # the session's rows fill its replica: the third goes to the other one, its new home
    _call(router, ["a", "a", "a"])
    assert [r for _, r in replicas.placed] == [home, home, 1 - home]
    replicas.placed.clear()
    _call(router, ["a"])
    assert replicas.placed == [("a", 1 - home)]
    # a row far above the slack on the home replica sends the next one elsewhere too
    replicas.placed.clear()
    _call(router, ["a", "a"], cost=AFFINITY_SLACK_TOKENS + 1)
    assert [r for _, r in replicas.placed] == [1 - home, home]


def test_calls_submitted_in_one_turn_of_the_loop_go_out_in_one_add_rows_per_replica():
    """A burst of one-row calls (a server taking its requests) costs one message per replica,
    not one per call, and every call still gets its own row back."""
    replicas = FakeReplicas(2, finish_at_once=True)
    router = RowRouter(replicas, capacity=8)  # type: ignore[arg-type]

    async def one(i: int) -> list[int]:
        request = RowRequest(f"one-{i}", [1, 2], {"max_tokens": 4})
        loop = asyncio.get_running_loop()
        return [j async for d in router.run([request], [4], 5.0, loop) for j, _ in d.items]

    async def burst() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i) for i in range(10))))

    assert asyncio.run(burst()) == [[0]] * 10
    assert replicas.add_calls == 2
    assert sorted(r for _, r in replicas.placed) == [0] * 5 + [1] * 5
    assert router.rows == [0, 0]
