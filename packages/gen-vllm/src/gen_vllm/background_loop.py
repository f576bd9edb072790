"""``BackgroundLoop``: the driver's own asyncio event loop, on a daemon thread.

``VllmGeneration`` has one asynchronous core (routing rows to replicas and awaiting them). The
synchronous ``generate`` runs it here and waits, so it works from any thread, including one whose
own event loop is running; ``generate_async`` runs it here too and hands each item over to the
caller's loop as it arrives.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["BackgroundLoop"]

T = TypeVar("T")

_DONE = object()


class BackgroundLoop:
    """An event loop running on its own thread until ``close()``."""

    def __init__(self, name: str = "gen-vllm-driver"):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on this loop and wait for its result (or its exception)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

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

    def close(self) -> None:
        """Stop the loop and join its thread. Idempotent."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


def _swallow(future: Any) -> Any:
    """A future that settles when ``future`` does, never raising its cancellation."""
    import concurrent.futures

    settled: concurrent.futures.Future[None] = concurrent.futures.Future()
    future.add_done_callback(lambda _: settled.set_result(None))
    return settled
