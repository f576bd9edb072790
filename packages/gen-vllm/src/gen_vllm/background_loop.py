"""``BackgroundLoop``: the driver's own asyncio event loop, on a daemon thread.

``VllmGeneration`` has one asynchronous core (routing rows to replicas, reading their streams),
which lives on this loop. The synchronous ``generate`` runs a call here and waits, so it works
from any thread, including one whose own event loop is running; ``generate_async`` and
``generate_stream`` iterate on the caller's own loop, to which the router hands their items.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["BackgroundLoop"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: How long cancelled work may take to clean up (abort its rows) before giving up on it.
_GRACE_S = 10.0


class BackgroundLoop:
    """An event loop running on its own thread until ``close()``."""

    def __init__(self, name: str = "gen-vllm-driver"):
        self._closing = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop itself (to hand work to it from other threads)."""
        return self._loop

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


def _swallow(future: Any) -> Any:
    """A future that settles when ``future`` does, never raising its cancellation."""
    settled: concurrent.futures.Future[None] = concurrent.futures.Future()
    future.add_done_callback(lambda _: settled.set_result(None))
    return settled
