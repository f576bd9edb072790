"""``TokenStreams``: rows streamed token by token, merged with the rows' final results.

A streaming call's rows run like any other (``RowRouter``), each flagged ``stream``; while any
such row is in flight, one poller per replica asks its worker for new tokens
(``VllmGenerationWorker.token_deltas``) and hands each to the call that owns the row. A row's
final ``RowOutput`` stays the authority: tokens that reach the driver after their row's result
are dropped (the result already holds them).

Runs on the driver's ``BackgroundLoop``; not thread-safe.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

from gen_vllm.messages import RowOutput, RowRequest, TokenDelta
from gen_vllm.replicas import ReplicaSet

__all__ = ["TokenStreams"]

#: What a streaming call's queue holds: a row's step, a failure, or None at the end.
_Item = tuple[int, TokenDelta | RowOutput] | BaseException | None

logger = logging.getLogger(__name__)

#: How long one poll waits on a worker with nothing new (a poller stops after the poll during
#: which its last listener left, so this bounds how long an idle poller lingers).
_POLL_S = 1.0


class TokenStreams:
    """New tokens of streaming rows, polled from every replica while some row listens."""

    def __init__(self, replicas: ReplicaSet, poll_s: float = _POLL_S):
        self._replicas = replicas
        self._poll_s = poll_s
        self._listeners: dict[str, Callable[[TokenDelta], None]] = {}
        self._pollers: dict[int, asyncio.Task[None]] = {}

    async def run(
        self, requests: Sequence[RowRequest], rows: AsyncIterator[tuple[int, RowOutput]]
    ) -> AsyncGenerator[tuple[int, TokenDelta | RowOutput], None]:
        """Yield ``(index into requests, TokenDelta)`` as tokens come and ``(index, RowOutput)``
        as ``rows`` (the router's iterator over the same requests) yields each result; a row's
        deltas all come before its result.

        Raises:
            Whatever ``rows`` raises. Closing this iterator closes ``rows`` (its rows end).
        """
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        index_of = {r.request_id: i for i, r in enumerate(requests)}
        for request_id, index in index_of.items():
            self._listeners[request_id] = functools.partial(_put, queue, index)
        self._start_polling()

        async def results() -> None:
            try:
                async for item in rows:
                    queue.put_nowait(item)
            except Exception as exc:
                queue.put_nowait(exc)
            else:
                queue.put_nowait(None)

        task = asyncio.ensure_future(results())
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                index, step = item
                request_id = requests[index].request_id
                if isinstance(step, RowOutput):
                    self._listeners.pop(request_id, None)
                elif request_id not in self._listeners:
                    continue  # the row's result came first and holds these tokens
                yield index, step
        finally:
            for request_id in index_of:
                self._listeners.pop(request_id, None)
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _start_polling(self) -> None:
        for replica in range(len(self._replicas)):
            poller = self._pollers.get(replica)
            if poller is None or poller.done():
                self._pollers[replica] = asyncio.ensure_future(self._poll(replica))

    async def _poll(self, replica: int) -> None:
        while self._listeners:
            try:
                deltas = await self._replicas.token_deltas(replica, self._poll_s)
            except Exception as exc:  # the rows' own results report a failed worker
                logger.debug("polling replica %d for tokens failed: %s", replica, exc)
                return
            for delta in deltas:
                listener = self._listeners.get(delta.request_id)
                if listener is not None:
                    listener(delta)


def _put(queue: asyncio.Queue[_Item], index: int, delta: TokenDelta) -> None:
    queue.put_nowait((index, delta))
