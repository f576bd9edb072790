"""``RowRouter``: rows go to the replica with the least outstanding work and come back as they
finish.

Every row is its own request to a worker, so one replica with long rows never holds up the rows
of another, and the caller sees each row as soon as it ends. A replica takes at most
``capacity`` rows at once (its engine's ``max_num_seqs``); rows beyond that wait here and go to
whichever replica frees a slot first, so uneven row lengths even out across replicas. The load
counts are shared by every call in flight, so concurrent calls balance against each other.

A row of a session (``RowRequest.session``: turn k+1 of a conversation, whose prompt begins
with turn k's) goes to the replica that served the session's last row, whose prefix cache holds
the conversation, unless that replica is full or has more than twice the least-loaded one's
outstanding work (plus ``AFFINITY_SLACK_TOKENS``): then it goes to the least-loaded one, which
becomes the session's replica. The router remembers the last ``MAX_SESSIONS`` sessions.

Runs on the driver's ``BackgroundLoop``; not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from gen_interface import GenerationError

from gen_vllm.messages import RowOutput, RowRequest
from gen_vllm.replicas import ReplicaSet, translate_ray_error

__all__ = ["AFFINITY_SLACK_TOKENS", "MAX_SESSIONS", "RowRouter"]

#: Outstanding tokens a session's replica may carry beyond twice the least-loaded replica's
#: before the session's next row goes elsewhere: a cached prefix saves its prefill, about one
#: prompt's worth of work, which this much queueing would cost more than.
AFFINITY_SLACK_TOKENS = 1024
#: Sessions remembered (least recently used forgotten first).
MAX_SESSIONS = 100_000


class RowRouter:
    """Routes rows over ``replicas``.

    Args:
        replicas: the workers.
        capacity: most rows one replica runs at once.
    """

    def __init__(self, replicas: ReplicaSet, capacity: int):
        self._replicas = replicas
        self._capacity = capacity
        self.outstanding = [0] * len(replicas)  # estimated tokens still to generate, per replica
        self.rows = [0] * len(replicas)  # rows in flight, per replica
        self.tokens = [0] * len(replicas)  # tokens generated (not scored), per replica
        self.prompt_tokens = 0  # prompt tokens of generated rows (the prefix cache's queries)
        self.cached_tokens = 0  # of those, the tokens the replicas' prefix caches held
        self._homes: OrderedDict[str, int] = OrderedDict()  # session -> its replica
        self._freed: asyncio.Condition | None = None

    async def run(
        self, requests: Sequence[RowRequest], costs: Sequence[int], timeout_s: float
    ) -> AsyncGenerator[tuple[int, RowOutput], None]:
        """Yield ``(index into requests, output)`` as each row finishes.

        Args:
            requests: the rows, each with a request id unique among rows in flight.
            costs: each row's estimated work (its token budget), for balancing.
            timeout_s: the whole call's time limit.

        Raises:
            GenerationError: a worker failed or died, or the call passed ``timeout_s``. Rows
                still running are cancelled (aborted in their engines) on any exit, including
                the caller closing the iterator early.
        """
        loop = asyncio.get_running_loop()
        freed = self._condition()
        deadline = loop.time() + timeout_s
        waiting = deque(range(len(requests)))
        running: dict[asyncio.Task[RowOutput], tuple[int, int, Any]] = {}
        try:
            while waiting or running:
                while waiting and (replica := self._pick(requests[waiting[0]].session)) is not None:
                    index = waiting.popleft()
                    ref = self._replicas.generate(replica, requests[index])
                    self._take(replica, costs[index])
                    running[asyncio.ensure_future(_result(ref))] = (index, replica, ref)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise _timed_out(timeout_s, len(waiting) + len(running), len(requests))
                if not running:  # every replica is full of other calls' rows
                    async with freed:
                        try:
                            await asyncio.wait_for(freed.wait(), remaining)
                        except TimeoutError:
                            raise _timed_out(timeout_s, len(waiting), len(requests)) from None
                    continue
                done, _ = await asyncio.wait(
                    running, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    index, replica, _ = running.pop(task)
                    await self._give_back(replica, costs[index])
                    row = task.result()
                    if row.prompt_logprobs is None:
                        self.tokens[replica] += len(row.token_ids)
                        self.prompt_tokens += len(requests[index].prompt)
                        self.cached_tokens += row.cached_tokens
                    yield index, row
        finally:
            for task, (index, replica, ref) in running.items():
                _cancel(ref)
                task.cancel()
                self._untake(replica, costs[index])
            if running:
                async with freed:
                    freed.notify_all()

    def _pick(self, session: str | None) -> int | None:
        """The replica for a row of ``session`` (None: no session), or None when all are full."""
        least = self._least_loaded()
        if least is None or session is None:
            return least
        home = self._homes.pop(session, None)
        stays = (
            home is not None
            and self.rows[home] < self._capacity
            and self.outstanding[home] <= 2 * self.outstanding[least] + AFFINITY_SLACK_TOKENS
        )
        replica = home if stays and home is not None else least
        self._homes[session] = replica
        if len(self._homes) > MAX_SESSIONS:
            self._homes.popitem(last=False)
        return replica

    def _least_loaded(self) -> int | None:
        free = [r for r in range(len(self.rows)) if self.rows[r] < self._capacity]
        return min(free, key=lambda r: (self.outstanding[r], self.rows[r], r)) if free else None

    def _take(self, replica: int, cost: int) -> None:
        self.rows[replica] += 1
        self.outstanding[replica] += cost

    def _untake(self, replica: int, cost: int) -> None:
        self.rows[replica] -= 1
        self.outstanding[replica] -= cost

    async def _give_back(self, replica: int, cost: int) -> None:
        self._untake(replica, cost)
        async with self._condition():
            self._condition().notify_all()

    def _condition(self) -> asyncio.Condition:
        if self._freed is None:
            self._freed = asyncio.Condition()
        return self._freed


def _timed_out(timeout_s: float, unfinished: int, total: int) -> GenerationError:
    return GenerationError(
        f"generate did not finish within {timeout_s:g} s ({unfinished} of {total} rows "
        "unfinished; vllm_cfg.generate_timeout_s sets the limit)"
    )


async def _result(ref: Any) -> RowOutput:
    try:
        return await ref
    except Exception as exc:
        raise translate_ray_error(exc, "generate") from exc


def _cancel(ref: Any) -> None:
    import ray

    with contextlib.suppress(Exception):  # the row finished meanwhile, or its worker is gone
        ray.cancel(ref)
