"""``BackgroundLoop``: the driver's own asyncio event loop, on a daemon thread.

``VllmGeneration`` has one asynchronous core (routing rows to replicas and awaiting them). The
synchronous ``generate`` runs it here and waits, so it works from any thread, including one whose
own event loop is running; ``generate_async`` runs it here too and hands each item over to the
caller's loop as it arrives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["BackgroundLoop"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: How long cancelled work may take to clean up (abort its rows) before giving up on it.
_GRACE_S = 10.0

_DONE = object()


class BackgroundLoop:
    """An event loop running on its own thread until ``close()``."""

    def __init__(self, name: str = "gen-vllm-driver"):
        self._closing = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on this loop and wait for its result (or its exception).

        If the wait itself is interrupted (``KeyboardInterrupt`` in the calling thread), the
        coroutine is cancelled, so its clean-up (aborting its rows) runs before this raises.
        """
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            if not future.done():
                future.cancel()
                concurrent.futures.wait([future], timeout=_GRACE_S)
            raise

    async def stream(self, make: Callable[[], AsyncGenerator[T, None]]) -> AsyncIterator[T]:
        """Iterate, on the caller's loop, an async iterator that runs on this loop.

        Items are handed over as they come. Closing the returned iterator early (or cancelling
        the task reading it) closes the source iterator on this loop, so its clean-up runs.
        """
        caller = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            source = make()
            try:
                async for item in source:
                    caller.call_soon_threadsafe(queue.put_nowait, item)
            except Exception as exc:
                caller.call_soon_threadsafe(queue.put_nowait, _Raised(exc))
            else:
                caller.call_soon_threadsafe(queue.put_nowait, _DONE)
            finally:
                await source.aclose()  # on cancellation too: the source's clean-up runs

        task = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    return
                if isinstance(item, _Raised):
                    raise item.error
                yield item
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wrap_future(_swallow(task))

    def close(self, timeout_s: float = _GRACE_S) -> None:
        """Cancel every task still on the loop, give them ``timeout_s`` to clean up, stop the
        loop and join its thread. Idempotent; never waits longer than about twice
        ``timeout_s``. A thread that does not stop in time is left to exit with the process
        (it is a daemon), and the loop is not closed under it."""
        if self._closing:
            return
        self._closing = True
        if self._thread.is_alive():
            drained = asyncio.run_coroutine_threadsafe(_cancel_tasks(timeout_s), self._loop)
            with contextlib.suppress(Exception):
                drained.result(timeout=timeout_s + 1)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            logger.warning(
                "the driver's event loop did not stop within %.0f s; leaving it", timeout_s
            )
            return
        self._loop.close()


async def _cancel_tasks(timeout_s: float) -> None:
    """Cancel every other task of the running loop and wait up to ``timeout_s`` for them."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


def _swallow(future: Any) -> Any:
    """A future that settles when ``future`` does, never raising its cancellation."""
    settled: concurrent.futures.Future[None] = concurrent.futures.Future()
    future.add_done_callback(lambda _: settled.set_result(None))
    return settled
