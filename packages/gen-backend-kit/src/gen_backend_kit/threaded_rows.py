"""Rows decoded on a thread, handed to an event loop as they come.

``rows_from_thread(run_rows)`` runs a backend's blocking decode loop (``_run_rows``) on a
thread of its own and yields, on the caller's event loop, what the loop reports through its
``RowControl``: each token (when asked) and each finished row; rows it returns without
reporting come after it returns. Closing the iterator early cancels the loop and waits for it.

``CallThreads`` holds a backend's running call threads, so that its shutdown cancels them and
waits for them: a process that exits while one is inside a torch operation aborts ("terminate
called without an active exception"), as a server stopped mid-request did.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from gen_interface.events import RowEvent

from gen_backend_kit.outputs import RowResult
from gen_backend_kit.stepping import RowControl

__all__ = ["CallThreads", "rows_from_thread"]


class CallThreads:
    """The threads running one backend's calls, each with its call's ``RowControl``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[threading.Thread, RowControl] = {}

    def start(self, target: Callable[[], None], control: RowControl, name: str) -> None:
        """Run ``target`` on a (daemon) thread of its own, held here until it returns."""

        def run() -> None:
            try:
                target()
            finally:
                with self._lock:
                    self._running.pop(thread, None)

        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._running[thread] = control
        thread.start()

    def stop(self, timeout_s: float) -> list[str]:
        """Cancel every running call and wait up to ``timeout_s`` in all for their threads;
        returns the names of those still running."""
        with self._lock:
            running = dict(self._running)
        for control in running.values():
            control.cancelled.set()
        deadline = time.monotonic() + timeout_s
        for thread in running:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [thread.name for thread in running if thread.is_alive()]


async def rows_from_thread(
    run_rows: Callable[[RowControl], Sequence[RowResult | None]],
    *,
    tokens: bool,
    name: str,
    threads: CallThreads | None = None,
) -> AsyncIterator[tuple[int, RowEvent | RowResult]]:
    """Yield ``(row index, RowEvent)`` for each token (when ``tokens``) and ``(row index,
    RowResult)`` for each finished row of ``run_rows`` running on a thread named after
    ``name`` (held by ``threads`` while it runs, when given).

    Raises:
        Whatever ``run_rows`` raises, once the rows it reported were yielded.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, RowEvent | RowResult] | None] = asyncio.Queue()
    handoff = _Handoff(loop, queue)

    def on_token(i: int, token: int, lp: float, ids: list[int], lps: list[float]) -> None:
        handoff.put((i, RowEvent(i, [token], [lp], [ids], [lps])))

    control = RowControl(
        on_row=lambda i, row: handoff.put((i, row)),
        on_token=on_token if tokens else None,
    )

    worker: asyncio.Future[Sequence[RowResult | None]] = loop.create_future()

    def settle(outcome: Any, error: BaseException | None) -> None:
        if not worker.done():
            if error is not None:
                worker.set_exception(error)
            else:
                worker.set_result(outcome)
        queue.put_nowait(None)

    def run() -> None:
        outcome: Any = None
        error: BaseException | None = None
        try:
            outcome = run_rows(control)
        except BaseException as exc:
            error = exc
        handoff.flush_then(settle, outcome, error)

    # A thread of its own per call, not a pool's: calls run side by side (in-process
    # backends interleave them step by step), so a short one never waits for a long one.
    if threads is not None:
        threads.start(run, control, f"{name}-call")
    else:
        threading.Thread(target=run, name=f"{name}-call", daemon=True).start()
    finished: set[int] = set()
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item[1], RowResult):
                finished.add(item[0])
            yield item
        for index, row in enumerate(await worker):
            if row is not None and index not in finished:
                yield index, row
    finally:
        if not worker.done():  # the caller stopped reading: end the call, then wait for it
            control.cancelled.set()
            with contextlib.suppress(Exception):
                await asyncio.shield(worker)


class _Handoff:
    """Items from a decoding thread to an event loop's queue, in order, many per wake-up.

    Waking the loop costs a system call and a turn of the GIL; one per token (a batch of 256
    rows is 256 tokens a step) slowed a streamed call by a tenth. Items wait in a list until the
    loop runs the one drain scheduled for them.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any]):
        self._loop = loop
        self._queue = queue
        self._lock = threading.Lock()
        self._items: list[Any] = []

    def put(self, item: Any) -> None:
        with self._lock:
            self._items.append(item)
            first = len(self._items) == 1
        if first:  # the list was empty: no drain is scheduled
            self._call_soon(self._drain)

    def flush_then(self, callback: Any, *args: Any) -> None:
        """Hand over what waits, then run ``callback(*args)`` on the loop."""

        def both() -> None:
            self._drain()
            callback(*args)

        self._call_soon(both)

    def _call_soon(self, callback: Any) -> None:
        """Schedule ``callback`` on the loop; nothing when the loop is closed (its consumer
        closed the stream early and left: no one is waiting for the rest)."""
        try:
            self._loop.call_soon_threadsafe(callback)
        except RuntimeError:
            if not self._loop.is_closed():
                raise

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for item in items:
            self._queue.put_nowait(item)
