"""``EngineLoop`` on stub engines: a row given up while its command waits in the queue leaves
the engine thread running and the engine empty; a row vLLM ends for an error fails, and a
failed step makes every later row say the engine is unusable."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch
from gen_interface import BackendBrokenError, GenerationError
from gen_vllm.engine import EngineLimits, EngineStep, StepOutput
from gen_vllm.engine_loop import WIDE_ROWS, EngineFailedError, EngineLoop
from gen_vllm.messages import RowRequest


class StubEngine:
    """Holds rows and never finishes them; every other engine call does nothing."""

    limits = EngineLimits(vocab_size=16, max_model_len=64, dtype="float32", model="stub")

    def __init__(self) -> None:
        self.rows: set[str] = set()

    def add_request(
        self, request_id: str, prompt: list[int], params: dict, stream: bool = False
    ) -> None:
        self.rows.add(request_id)

    def step(self) -> EngineStep:
        time.sleep(0.001)
        return EngineStep([], [])

    def abort(self, request_ids: list[str]) -> list[StepOutput]:
        live = sorted(self.rows.intersection(request_ids))
        self.rows.difference_update(request_ids)
        return [StepOutput(r, [], [], "abort") for r in live]

    def shutdown(self) -> None:
        return None


@pytest.fixture
def loop():
    engine_loop = EngineLoop(StubEngine)
    yield engine_loop
    engine_loop.close()


def test_a_row_given_up_while_its_command_waits_leaves_the_thread_running(loop):
    engine: StubEngine = loop.engine  # type: ignore[assignment]
    release = threading.Event()
    loop.post(lambda: release.wait(10))  # the engine thread is busy: the row's command waits

    async def give_up_on_a_row() -> None:
        row = asyncio.ensure_future(loop.generate(RowRequest("r0", [1, 2], {})))
        await asyncio.sleep(0.05)
        row.cancel()
        with pytest.raises(asyncio.CancelledError):
            await row

    asyncio.run(give_up_on_a_row())
    release.set()
    assert loop.submit(lambda: "alive").result(timeout=5) == "alive"
    assert loop.in_flight == 0 and engine.rows == set()


def test_a_row_given_up_while_running_is_aborted_in_the_engine(loop):
    engine: StubEngine = loop.engine  # type: ignore[assignment]

    async def give_up_on_a_running_row() -> None:
        row = asyncio.ensure_future(loop.generate(RowRequest("r1", [1, 2], {})))
        while loop.in_flight == 0:
            await asyncio.sleep(0.01)
        row.cancel()
        with pytest.raises(asyncio.CancelledError):
            await row

    asyncio.run(give_up_on_a_running_row())
    assert loop.submit(lambda: "alive").result(timeout=5) == "alive"
    assert loop.in_flight == 0 and engine.rows == set()


class ScriptedEngine(StubEngine):
    """Finishes every row at its first step for ``reason``; ``explode`` makes steps raise;
    ``finished_at``: the engine's own stamp on its steps (None: it has none)."""

    reason = "stop"
    explode = False
    finished_at: float | None = None

    def step(self) -> EngineStep:
        if self.explode:
            raise RuntimeError("a kernel failed")
        done, self.rows = self.rows, set()
        ended = [StepOutput(r, [3], [-0.5], self.reason) for r in sorted(done)]
        return EngineStep([], ended, self.finished_at)


@pytest.fixture
def scripted():
    engine_loop = EngineLoop(ScriptedEngine)
    yield engine_loop
    engine_loop.close()


def test_a_finish_reason_vllm_gives_for_an_error_fails_the_row_not_a_length_cut_off(scripted):
    """Fails on the main before the shared base: ``"error"`` came back as ``"length"``."""
    scripted.engine.reason = "error"
    with pytest.raises(GenerationError, match=r"'error'.*failed inside the engine"):
        asyncio.run(scripted.generate(RowRequest("r1", [1, 2], {})))
    scripted.engine.reason = "stop"  # the engine itself is fine: the next row runs
    out = asyncio.run(scripted.generate(RowRequest("r2", [1, 2], {})))
    assert out.finish_reason == "stop" and out.token_ids == [3]


def test_a_failed_step_is_fatal_and_says_so_on_every_later_row(scripted):
    scripted.engine.explode = True
    with pytest.raises(EngineFailedError, match="a kernel failed"):
        asyncio.run(scripted.generate(RowRequest("r1", [1, 2], {})))
    scripted.engine.explode = False
    with pytest.raises(EngineFailedError, match="unusable: an engine step failed"):
        asyncio.run(scripted.generate(RowRequest("r2", [1, 2], {})))
    assert isinstance(EngineFailedError("x"), BackendBrokenError)


def test_rows_added_in_a_batch_leave_through_the_feed_one_message_per_step(scripted):
    async def run() -> list[object]:
        await scripted.add_rows([RowRequest(f"b{i}", [1, 2], {}) for i in range(3)])
        batch = await scripted.feed.take()
        assert batch is not None
        return sorted(request_id for request_id, _ in batch.finished)

    assert asyncio.run(run()) == ["b0", "b1", "b2"]


@pytest.mark.parametrize("stamped", [True, False])
def test_a_step_s_message_is_timed_from_the_engine_s_own_stamp_where_it_has_one(scripted, stamped):
    """Delivery is measured from when the engine finished the step (vLLM stamps its core
    outputs before it builds any output), not from when the loop got round to pushing."""
    stamp = time.time() - 0.25
    scripted.engine.finished_at = stamp if stamped else None

    async def run() -> float:
        await scripted.add_rows([RowRequest("t0", [1, 2], {})])
        batch = await scripted.feed.take()
        assert batch is not None and [r for r, _ in batch.finished] == ["t0"]
        return batch.ended

    before = time.time()
    ended = asyncio.run(run())
    if stamped:
        assert ended == stamp
    else:
        assert before <= ended <= time.time()  # taken as the loop pushed


def test_a_row_cut_short_keeps_the_tokens_it_had_and_says_abort(loop):
    async def run() -> object:
        await loop.add_rows([RowRequest("c0", [1, 2], {})])
        assert loop.submit(loop.cut_all).result(timeout=5) == 1
        return await loop.feed.take()

    batch = asyncio.run(run())
    assert batch is not None
    ((request_id, row),) = batch.finished
    assert request_id == "c0" and row.finish_reason == "abort" and loop.in_flight == 0


def test_a_failed_step_fails_the_rows_added_in_a_batch_through_the_feed(scripted):
    scripted.engine.explode = True

    async def run() -> object:
        await scripted.add_rows([RowRequest("f0", [1, 2], {})])
        return await scripted.feed.take()

    batch = asyncio.run(run())
    assert batch is not None
    (failure,) = batch.failed
    assert failure.request_id == "f0" and failure.engine_failed
    with pytest.raises(EngineFailedError, match="unusable"):
        asyncio.run(scripted.add_rows([RowRequest("f1", [1, 2], {})]))


class ThreadCountingEngine(StubEngine):
    """Records the engine thread's torch thread count at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def step(self) -> EngineStep:
        self.threads.append(torch.get_num_threads())
        return super().step()


def test_a_step_takes_every_core_while_many_rows_run_and_none_streams():
    loop = EngineLoop(ThreadCountingEngine, num_threads=1, wide_threads=2)
    engine: ThreadCountingEngine = loop.engine  # type: ignore[assignment]

    def threads_while_running(rows: list[RowRequest]) -> int:
        asyncio.run(loop.add_rows(rows))
        seen = len(engine.threads)
        deadline = time.monotonic() + 10
        while len(engine.threads) < seen + 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        counted = engine.threads[-1]
        loop.abort_rows([row.request_id for row in rows])
        assert loop.submit(lambda: loop.in_flight).result(timeout=5) == 0
        return counted

    def rows(name: str, count: int, streaming: int = 0) -> list[RowRequest]:
        return [RowRequest(f"{name}{i}", [1, 2], {}, stream=i < streaming) for i in range(count)]

    try:
        assert threads_while_running(rows("few", WIDE_ROWS - 1)) == 1
        assert threads_while_running(rows("many", WIDE_ROWS)) == 2
        assert threads_while_running(rows("one-streams", WIDE_ROWS, streaming=1)) == 1
        assert threads_while_running(rows("again", 2 * WIDE_ROWS)) == 2
    finally:
        loop.close()


def test_without_a_thread_count_a_step_keeps_the_thread_s_own():
    loop = EngineLoop(ThreadCountingEngine, wide_threads=(os.cpu_count() or 1) + 1)
    engine: ThreadCountingEngine = loop.engine  # type: ignore[assignment]
    own = loop.run(torch.get_num_threads)  # the engine thread's count, not this thread's
    try:
        asyncio.run(loop.add_rows([RowRequest(f"r{i}", [1], {}) for i in range(WIDE_ROWS)]))
        deadline = time.monotonic() + 10
        while len(engine.threads) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert engine.threads and set(engine.threads) == {own}
    finally:
        loop.close()
