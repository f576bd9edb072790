"""``TokenFeed``: the new tokens of streaming rows, from an engine's thread to whoever polls.

The engine thread pushes every step's new tokens of the rows that asked to stream
(``RowRequest.stream``); the driver polls with ``take``, which returns everything pushed since
its last poll, or waits for the next push. Polling, rather than one message per token, means a
busy driver gets many steps' tokens in one message: the cost is per poll, not per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence

from gen_vllm.messages import TokenDelta

__all__ = ["TokenFeed"]


class TokenFeed:
    """A thread-safe buffer of ``TokenDelta``s with one asynchronous reader at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deltas: list[TokenDelta] = []
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    def push(self, deltas: Sequence[TokenDelta]) -> None:
        """Add one step's deltas (from any thread) and wake the waiting reader."""
        if not deltas:
            return
        with self._lock:
            self._deltas.extend(deltas)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, future = waiter
            loop.call_soon_threadsafe(_settle, future)

    async def take(self, timeout_s: float) -> list[TokenDelta]:
        """Everything pushed since the last ``take``, in order; waits up to ``timeout_s`` for
        the first push when there is nothing yet (then returns an empty list)."""
        with self._lock:
            if not self._deltas:
                future = asyncio.get_running_loop().create_future()
                self._waiter = (asyncio.get_running_loop(), future)
            else:
                future = None
        if future is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(future), timeout_s)
        with self._lock:
            deltas, self._deltas = self._deltas, []
            if self._waiter is not None and self._waiter[1] is future:
                self._waiter = None
        return deltas


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
