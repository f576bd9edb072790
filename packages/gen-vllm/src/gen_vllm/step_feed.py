"""``StepFeed``: what an engine's steps produced, from the engine's thread to the driver.

The engine thread adds each step's output (the new tokens of rows that stream, the rows that
finished or failed); the worker's ``outputs`` stream takes everything added since it last took,
or waits for the next step. So the driver receives one message per engine step for all rows,
pushed as the step ends, and several steps in one message when it falls behind: the cost is
per message, never per row or per token.

A push that wakes an idle reader can hand it the process (``hand_over_s``): the pushing thread
waits, without the GIL, until the reader has taken the batch and come back for the next, so
that the message is encoded and sent before the engine's next step begins, not beside it. A
reader woken beside the running step waited 3-9 ms for its turn (p50, 64-256 rows; a shorter
GIL switch interval did not shorten it), and now 1.5-3.3 ms to the driver, for a wait of about
the message's encoding and write on the engine's side.

While the engine steps without producing anything the driver reads (rows that report only at
their end), a message carrying only the step count goes out at most every ``HEARTBEAT_S``: the
driver's proof that a replica holding rows still makes progress (a wedged one sends nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence

from gen_vllm.messages import RowFailure, RowOutput, StepBatch, TokenDelta

__all__ = ["HAND_OVER_S", "HEARTBEAT_S", "StepFeed"]

#: The longest an engine that steps goes without a message to the driver.
HEARTBEAT_S = 1.0
#: The longest a push waits for the reader it woke to send the batch and come back.
HAND_OVER_S = 0.005


class StepFeed:
    """A thread-safe ``StepBatch`` being filled, with one asynchronous reader at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reader_back = threading.Condition(self._lock)  # a reader waits in ``take``
        self._batch = StepBatch()
        self._closed = False
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None
        self._beat = False  # a batch of steps alone is due
        self._last_taken = time.monotonic()

    def push(
        self,
        deltas: Sequence[TokenDelta] = (),
        finished: Sequence[tuple[str, RowOutput]] = (),
        failed: Sequence[RowFailure] = (),
        step_seconds: float | None = None,
        hand_over_s: float = 0.0,
        finished_at: float | None = None,
    ) -> None:
        """Add one step's output (from any thread but the reader's) and wake the waiting
        reader. ``step_seconds``: the step took that long (counted; None: not a step).
        ``hand_over_s``: when a reader was waiting, wait up to that long for it to take this
        batch and come back for the next (see the module). ``finished_at``: when the engine
        finished the step (``time.time()``; None: now), the batch's ``ended``."""
        ended = time.time() if finished_at is None else finished_at
        with self._lock:
            if step_seconds is not None:
                self._batch.steps += 1
                self._batch.step_seconds += step_seconds
            if not (deltas or finished or failed):
                if not self._batch.steps or time.monotonic() - self._last_taken < HEARTBEAT_S:
                    return
                self._beat = True
            self._batch.deltas.extend(deltas)
            self._batch.finished.extend(finished)
            self._batch.failed.extend(failed)
            self._batch.ended = ended
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            _wake(waiter)
            if hand_over_s > 0:
                with self._lock:
                    self._reader_back.wait_for(
                        lambda: self._waiter is not None or self._closed, hand_over_s
                    )

    def close(self) -> None:
        """End the feed: the reader gets what is left, then None."""
        with self._lock:
            self._closed = True
            self._reader_back.notify_all()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            _wake(waiter)

    async def take(self) -> StepBatch | None:
        """Everything added since the last ``take``; waits for the next step when nothing is
        there yet. None once the feed is closed and empty."""
        while True:
            with self._lock:
                if self._batch or self._beat or self._closed:
                    batch, self._batch = self._batch, StepBatch()
                    self._beat = False
                    self._last_taken = time.monotonic()
                    return batch if batch or batch.steps else None
                loop = asyncio.get_running_loop()
                future: asyncio.Future[None] = loop.create_future()
                self._waiter = (loop, future)
                self._reader_back.notify_all()
            await future


def _wake(waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]) -> None:
    loop, future = waiter

    def settle() -> None:
        if not future.done():
            future.set_result(None)

    with contextlib.suppress(RuntimeError):  # the reader's loop is closed: nobody waits
        loop.call_soon_threadsafe(settle)
