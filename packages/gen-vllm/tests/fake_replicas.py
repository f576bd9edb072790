"""A stand-in for ``ReplicaSet`` on the driver's side of the token path, for router tests.

Each replica keeps its rows and pushes ``StepBatch``es through ``outputs`` as the real workers'
streams do; how rows progress is the test's: ``finish_at_once`` ends every row as it arrives,
else rows run until the test calls ``emit``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from gen_vllm import wire
from gen_vllm.messages import RowOutput, RowRequest, StepBatch, TokenDelta


class FakeReplicas:
    """``len(replicas)`` replicas whose engines the test drives."""

    def __init__(self, replicas: int, *, finish_at_once: bool = False):
        self.finish_at_once = finish_at_once
        self.placed: list[tuple[str | None, int]] = []  # (session, replica) per row, in order
        self.running: list[dict[str, RowRequest]] = [{} for _ in range(replicas)]
        self.aborted: list[str] = []
        self.add_calls = 0
        # each replica's pending steps, and the event loop they belong to (tests may run
        # several loops one after another)
        self._queues: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[StepBatch | None]]] = []
        self._replica_count = replicas

    def __len__(self) -> int:
        return len(self.running)

    def add_rows(self, replica: int, requests: list[RowRequest]) -> asyncio.Future[None]:
        self.add_calls += 1
        for request in requests:
            self.placed.append((request.session, replica))
            self.running[replica][request.request_id] = request
        if self.finish_at_once:
            self.emit(replica, finished=[r.request_id for r in requests])
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def abort_rows(self, replica: int, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self.running[replica].pop(request_id, None)

    def outputs(self, replica: int) -> AsyncIterator[bytes]:
        return self._stream(replica)

    def emit(
        self,
        replica: int,
        *,
        tokens: dict[str, list[int]] | None = None,
        finished: list[str] = (),  # type: ignore[assignment]
        ended: float | None = None,
    ) -> None:
        """Push one step: new tokens of the given rows, then the given rows' results;
        ``ended``: when the step ended (``time.time()``; default now)."""
        batch = StepBatch(ended=time.time() if ended is None else ended)
        for request_id, ids in (tokens or {}).items():
            batch.deltas.append(TokenDelta(request_id, ids, [-1.0] * len(ids), [], []))
        for request_id in finished:
            self.running[replica].pop(request_id, None)
            row = RowOutput(token_ids=[7], logprobs=[-1.0], finish_reason="stop")
            batch.finished.append((request_id, row))
        self._queue(replica).put_nowait(batch)

    def die(self, replica: int) -> None:
        """The replica's stream fails, as a dead worker's does."""
        self._queue(replica).put_nowait(None)

    def _queue(self, replica: int) -> asyncio.Queue[StepBatch | None]:
        loop = asyncio.get_running_loop()
        if not self._queues or self._queues[0][0] is not loop:
            self._queues = [(loop, asyncio.Queue()) for _ in range(self._replica_count)]
        return self._queues[replica][1]

    async def _stream(self, replica: int) -> AsyncIterator[bytes]:
        while (batch := await self._queue(replica).get()) is not None:
            yield wire.encode(batch)  # as a worker's stream sends it
        raise ConnectionError(f"replica {replica}'s worker died")
