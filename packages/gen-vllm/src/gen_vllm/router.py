"""``RowRouter``: rows go to the replica with the least outstanding work, in batches, and come
back through one stream per replica as they finish.

A call's rows are spread over the replicas by their outstanding work and sent to each replica
in one ``add_rows`` call; calls that arrive while the driver's loop is busy go out together,
one ``add_rows`` per replica for all of them (a burst of one-row calls, as a server takes its
requests, costs a few messages rather than one each). Each replica pushes what its engine
produces through one stream (``VllmGenerationWorker.outputs``): one message per engine step
for all its rows, whichever calls they belong to. One reader per replica hands each finished
row (and each new token of a row that streams) straight to its call's event loop: per message,
one hand-over per caller's loop, carrying every call's part. So nothing on the token path costs
a Ray call per row, per token or per poll, nor a thread wake-up per call.

A replica takes at most ``capacity`` rows at once (its engine's ``max_num_seqs``); rows beyond
that wait here and go to whichever replica frees a slot first, so uneven row lengths even out
across replicas. The load counts are shared by every call in flight, so concurrent calls balance
against each other.

A row of a session (``RowRequest.session``: turn k+1 of a conversation, whose prompt begins
with turn k's) goes to the replica that served the session's last row, whose prefix cache holds
the conversation, unless that replica is full or has more than twice the least-loaded one's
outstanding work (plus ``AFFINITY_SLACK_TOKENS``): then it goes to the least-loaded one, which
becomes the session's replica. The router remembers the last ``MAX_SESSIONS`` sessions.

The router's state lives on the driver's event loop (``driver``): dispatch, the replicas'
streams and the load counts. A call iterates ``rows`` on its own loop, any thread's; its
bookkeeping is handed to the driver's loop, and its items are handed back.

Healing (a ``FleetHealth`` given): rows go only to replicas that take rows. A replica whose
stream ends with an error (its worker died), whose engine failed, or that holds rows without
sending anything for ``wedge_timeout_s`` (a working engine sends at least a heartbeat every
second, ``step_feed.HEARTBEAT_S``) is lost: ``on_lost`` kills and replaces it, and its rows move.
A row that has not handed a token to its caller runs again from its prompt on a serving
replica, with its own settings and seed, so it gives what it would have given there (and what a
fault-free call gives: a row depends only on its prompt, settings, seed and weights); a row that
already streamed tokens ends its call with ``RowLostError`` naming it, never contradicting
what was delivered. With no replica left that takes rows, calls fail at once with
``NoReplicaServingError``. Without a ``FleetHealth``, a lost replica fails its rows' calls (the
fail-stop setting, ``vllm_cfg.healing: false``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gen_backend_kit.fleet_health import FleetHealth, ReplicaState
from gen_backend_kit.speculation import SpeculationCounts
from gen_interface import GenerationError, NoReplicaServingError, RowLostError

from gen_vllm import wire
from gen_vllm.delivery import DeliveryTimes
from gen_vllm.engine_loop import EngineFailedError
from gen_vllm.messages import RowOutput, RowRequest, StepBatch, TokenDelta
from gen_vllm.replicas import ReplicaSet, WorkerLostError, translate_ray_error

__all__ = ["AFFINITY_SLACK_TOKENS", "MAX_SESSIONS", "Delivery", "RowItem", "RowRouter"]

logger = logging.getLogger(__name__)

#: Outstanding tokens a session's replica may carry beyond twice the least-loaded replica's
#: before the session's next row goes elsewhere: a cached prefix saves its prefill, about one
#: prompt's worth of work, which this much queueing would cost more than.
AFFINITY_SLACK_TOKENS = 1024
#: Sessions remembered (least recently used forgotten first).
MAX_SESSIONS = 100_000

#: What a call receives: ``(index into its requests, new tokens or the row's result)``.
RowItem = tuple[int, TokenDelta | RowOutput]


@dataclass(frozen=True)
class Delivery:
    """A call's part of one worker message.

    Attributes:
        items: its rows' new tokens and results, in the order the engine made them.
        ended: when the engine step that made them ended (``StepBatch.ended``).
    """

    items: list[RowItem]
    ended: float


@dataclass(eq=False)
class _Call:
    """One call: its rows, where its items go, which of its rows are out and where."""

    caller: asyncio.AbstractEventLoop  # the loop the call iterates on
    inbox: asyncio.Queue[Delivery | BaseException]  # on ``caller``
    requests: Sequence[RowRequest]
    costs: Sequence[int]
    waiting: deque[int] = field(default_factory=deque)  # rows not yet sent, in order
    #: request id -> (index in the call, replica, cost), for the rows sent
    live: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    over: bool = False  # the caller stopped listening
    streamed: set[int] = field(default_factory=set)  # rows that handed the caller a token


class RowRouter:
    """Routes rows over ``replicas``.

    Args:
        replicas: the workers.
        capacity: most rows one replica runs at once.
        health: the fleet's health, when it heals (None: fail-stop).
        on_lost: called on the driver's loop with a replica and why, once per loss, when
            healing: kill it and start its replacement.
        wedge_timeout_s: how long a replica may hold rows without sending anything.
    """

    def __init__(
        self,
        replicas: ReplicaSet,
        capacity: int,
        *,
        health: FleetHealth | None = None,
        on_lost: Callable[[int, str], None] | None = None,
        wedge_timeout_s: float = 30.0,
    ):
        self._replicas = replicas
        self._capacity = capacity
        self._health = health
        self._on_lost = on_lost
        self._wedge_s = wedge_timeout_s
        self._progress = [0.0] * len(replicas)  # driver-loop time of each one's last message
        self._watchdog: asyncio.Task[None] | None = None
        #: An update holds the engines paused: no progress is expected (set by the fleet).
        self.paused = False
        self.rows_rerun = 0  # rows moved from a lost replica and run again elsewhere
        self.rows_lost = 0  # rows that had streamed tokens when their replica was lost
        self.outstanding = [0] * len(replicas)  # estimated tokens still to generate, per replica
        self.rows = [0] * len(replicas)  # rows in flight, per replica
        self.tokens = [0] * len(replicas)  # tokens generated (not scored), per replica
        self.prompt_tokens = 0  # prompt tokens of generated rows (the prefix cache's queries)
        self.cached_tokens = 0  # of those, the tokens the replicas' prefix caches held
        self.engine_steps = [0] * len(replicas)  # engine steps, per replica
        self.engine_seconds = [0.0] * len(replicas)  # the time those steps took
        #: Drafts, proposed and accepted tokens of the generated rows (speculative decoding).
        self.speculation = SpeculationCounts()
        #: From a step's end to its rows' tokens or results reaching this router.
        self.arrivals = DeliveryTimes("step_to_driver")
        self._homes: OrderedDict[str, int] = OrderedDict()  # session -> its replica
        self._routes: dict[str, tuple[_Call, bool, int]] = {}  # id -> call, streams, prompt len
        self._readers: list[asyncio.Task[None] | None] = [None] * len(replicas)
        self._lost: list[GenerationError | None] = [None] * len(replicas)
        self._queued: deque[_Call] = deque()  # calls with rows waiting for room, oldest first
        self._dispatch_due = False  # a dispatch of newly submitted calls is scheduled

    async def run(
        self,
        requests: Sequence[RowRequest],
        costs: Sequence[int],
        timeout_s: float,
        driver: asyncio.AbstractEventLoop,
    ) -> AsyncGenerator[Delivery, None]:
        """Yield, as they come, ``Delivery``s of ``(index into requests, item)``: a
        ``TokenDelta`` of a row that streams (``RowRequest.stream``), or a row's ``RowOutput``
        once it finished; a row's tokens all come before its result. Iterate it on any event
        loop; ``driver`` is the loop the router lives on.

        Args:
            requests: the rows, each with a request id unique among rows in flight.
            costs: each row's estimated work (its token budget), for balancing.
            timeout_s: the whole call's time limit.
            driver: the router's own event loop.

        Raises:
            GenerationError: a row failed, a worker failed or died, or the call passed
                ``timeout_s``. Rows still running are aborted in their engines on any exit,
                including the caller closing the iterator early.
        """
        caller = asyncio.get_running_loop()
        deadline = caller.time() + timeout_s
        call = _Call(caller, asyncio.Queue(), requests, costs, deque(range(len(requests))))
        _on(driver, lambda: self._submit(call))
        finished = 0
        try:
            while finished < len(requests):
                remaining = deadline - caller.time()
                try:
                    if remaining <= 0:
                        raise TimeoutError
                    delivery = await asyncio.wait_for(call.inbox.get(), remaining)
                except TimeoutError:
                    raise _timed_out(timeout_s, len(requests) - finished, len(requests)) from None
                if isinstance(delivery, BaseException):
                    raise delivery
                finished += sum(isinstance(step, RowOutput) for _, step in delivery.items)
                yield delivery
        finally:
            call.over = True
            _on(driver, lambda: self._give_up(call))

    # ---- dispatch (on the driver's loop) -----------------------------------------------------

    def _submit(self, call: _Call) -> None:
        """Queue a new call; its rows go out at the loop's next turn, with those of every call
        submitted before then."""
        if call.over:
            return
        if self._health is not None and self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch())
        self._queued.append(call)
        if not self._dispatch_due:
            self._dispatch_due = True
            asyncio.get_running_loop().call_soon(self._dispatch_submitted)

    def _dispatch_submitted(self) -> None:
        self._dispatch_due = False
        self._dispatch()

    def _dispatch(self) -> None:
        """Send the queued calls' rows, oldest call first, as far as the replicas have room:
        one ``add_rows`` per replica."""
        if self._health is not None and self._queued and not self._any_taking_rows():
            self._no_replica_serves()
            return
        batches: dict[int, list[RowRequest]] = defaultdict(list)
        while self._queued:
            call = self._queued[0]
            while (
                call.waiting
                and (replica := self._pick(call.requests[call.waiting[0]].session)) is not None
            ):
                index = call.waiting.popleft()
                request = call.requests[index]
                self._take(replica, call.costs[index])
                call.live[request.request_id] = (index, replica, call.costs[index])
                self._routes[request.request_id] = (call, request.stream, len(request.prompt))
                batches[replica].append(request)
            if call.waiting:
                break  # every replica is full
            self._queued.popleft()
        for replica, batch in batches.items():
            self._read(replica)
            lost = self._lost[replica]
            if lost is not None:
                self._fail_rows(replica, [r.request_id for r in batch], lost)
                continue
            added = self._replicas.add_rows(replica, batch)
            task = asyncio.ensure_future(self._added(replica, added, batch, self._actor(replica)))
            task.add_done_callback(_log_unexpected)

    async def _added(self, replica: int, ref: Any, batch: list[RowRequest], actor: Any) -> None:
        """Fail the rows of a batch the replica refused (its engine failed, it died)."""
        try:
            await ref
        except Exception as exc:
            error = translate_ray_error(exc, "generate")
            if self._health is not None and isinstance(error, (WorkerLostError, EngineFailedError)):
                now = self._actor(replica)
                if now is None or now is actor:  # not a replacement admitted since
                    self._lose(replica, error)
                return
            self._fail_rows(replica, [r.request_id for r in batch], error)

    def _give_up(self, call: _Call) -> None:
        """The caller left: abort its rows still in flight and give their room back."""
        call.over = True
        with contextlib.suppress(ValueError):
            self._queued.remove(call)
        call.waiting.clear()
        by_replica: dict[int, list[str]] = defaultdict(list)
        for request_id, (_, replica, cost) in call.live.items():
            self._routes.pop(request_id, None)
            self._untake(replica, cost)
            by_replica[replica].append(request_id)
        call.live.clear()
        for replica, ids in by_replica.items():
            if self._lost[replica] is None:
                with contextlib.suppress(Exception):  # the worker is gone: nothing runs there
                    self._replicas.abort_rows(replica, ids)
        if by_replica:
            self._dispatch()

    # ---- the replicas' streams -------------------------------------------------------------

    def _read(self, replica: int) -> None:
        """Start reading ``replica``'s stream unless it is read already."""
        reader = self._readers[replica]
        if reader is None or reader.done():
            self._readers[replica] = asyncio.ensure_future(self._read_stream(replica))

    async def _read_stream(self, replica: int) -> None:
        actor = self._actor(replica)
        try:
            async for message in self._replicas.outputs(replica):
                self._deliver(replica, wire.decode(message))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = translate_ray_error(exc, "generate")
        else:
            error = GenerationError("a vLLM worker shut down while rows ran on it")
        now = self._actor(replica)
        if now is None or now is actor:  # a replacement admitted since has its own stream
            self._lose(replica, error)

    def _actor(self, replica: int) -> Any:
        """The actor serving as ``replica`` now (None where the replicas have no actors)."""
        actors = getattr(self._replicas, "actors", None)
        return actors[replica] if actors is not None and replica < len(actors) else None

    def _deliver(self, replica: int, batch: StepBatch) -> None:
        """Hand each call its part of one message: one hand-over per caller's loop."""
        healing = self._health is not None
        if healing:
            if self._lost[replica] is not None:
                return  # a lost replica's last words: its rows are elsewhere now
            self._progress[replica] = asyncio.get_running_loop().time()
            if self._health is not None and self._health.state(replica) is ReplicaState.SUSPECT:
                self._health.move(replica, ReplicaState.SERVING, "progress again")
        self.engine_steps[replica] += batch.steps
        self.engine_seconds[replica] += batch.step_seconds
        parts: dict[int, tuple[_Call, list[RowItem]]] = {}

        def part(call: _Call) -> list[RowItem]:
            return parts.setdefault(id(call), (call, []))[1]

        for delta in batch.deltas:
            route = self._routes.get(delta.request_id)
            if route is not None and route[1] and self._on(route[0], delta.request_id, replica):
                call = route[0]
                index = call.live[delta.request_id][0]
                call.streamed.add(index)
                part(call).append((index, delta))
        for request_id, row in batch.finished:
            route = self._routes.get(request_id)
            if route is None or not self._on(route[0], request_id, replica):
                continue  # given up on by its call
            self._routes.pop(request_id)
            call, _, prompt_length = route
            index, _, cost = call.live.pop(request_id)
            self._untake(replica, cost)
            if row.prompt_logprobs is None:
                self.tokens[replica] += len(row.token_ids)
                self.prompt_tokens += prompt_length
                self.cached_tokens += row.cached_tokens
                drafts, proposed, accepted = row.speculation
                if drafts or proposed:
                    self.speculation.add(drafts=drafts, proposed=proposed, accepted=accepted)
            part(call).append((index, row))
        engine_failed = None
        for failure in batch.failed:
            kind = EngineFailedError if failure.engine_failed else GenerationError
            if healing and failure.engine_failed:
                engine_failed = EngineFailedError(failure.message)
                continue  # the replica is lost below, and this row moves with the others
            self._fail_rows(replica, [failure.request_id], kind(failure.message))
        if parts:
            self.arrivals.record(time.time() - batch.ended)
        _hand_over([(call, Delivery(items, batch.ended)) for call, items in parts.values()])
        if engine_failed is not None:
            self._lose(replica, engine_failed)
        elif batch.finished:
            self._dispatch()

    def _lose(self, replica: int, error: GenerationError) -> None:
        """``replica``'s stream ended, or it wedged: fail-stop, every row on it fails with
        ``error``; healing, its rows move (see the module docstring)."""
        if self._health is None:
            self._lost[replica] = error
            ids = [i for i, (call, _, _) in self._routes.items() if self._on(call, i, replica)]
            self._fail_rows(replica, ids, error)
            return
        if self._lost[replica] is not None:
            return  # already lost: a dead stream and a failed call report it twice
        self._lost[replica] = error
        reader = self._readers[replica]
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
        self._readers[replica] = None
        if self._on_lost is not None:
            self._on_lost(replica, str(error))
        lost: dict[int, tuple[_Call, list[int]]] = {}
        moved: dict[int, tuple[_Call, list[int]]] = {}
        for request_id, (call, _, _) in list(self._routes.items()):
            if not self._on(call, request_id, replica):
                continue
            del self._routes[request_id]
            index, _, cost = call.live.pop(request_id)
            self._untake(replica, cost)
            into = lost if index in call.streamed else moved
            into.setdefault(id(call), (call, []))[1].append(index)
        for call, indexes in moved.values():
            self.rows_rerun += len(indexes)
            call.waiting.extendleft(sorted(indexes, reverse=True))
            if call not in self._queued:
                self._queued.appendleft(call)
        failed: list[tuple[_Call, Delivery | BaseException]] = []
        for call, indexes in lost.values():
            self.rows_lost += len(indexes)
            failed.append((call, _row_lost(sorted(indexes), replica, error)))
        _hand_over(failed)
        if moved:
            logger.warning(
                "replica %d lost (%s): %d row(s) run again on the others",
                replica,
                error,
                sum(len(i) for _, i in moved.values()),
            )
        self._dispatch()

    def watch(self) -> None:
        """Healing: read every replica's stream and watch for wedges from now on, so that a
        replica that dies while it holds no rows is seen within seconds, not at the next call
        that reaches it. Call on the driver's loop."""
        if self._health is None:
            return
        if self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch())
        for replica in range(len(self._readers)):
            if self._takes_rows(replica):
                self._read(replica)

    def admit(self, replica: int) -> None:
        """``replica`` (a replacement, admitted by the fleet) takes rows from now on; its
        stream is read at once."""
        self._lost[replica] = None
        self._readers[replica] = None
        self.rows[replica] = 0
        self.outstanding[replica] = 0
        self._progress[replica] = asyncio.get_running_loop().time()
        self._read(replica)
        self._dispatch()

    def lose(self, replica: int, why: str) -> None:
        """``replica`` was found dead or evicted outside the token path (a weight update):
        treat it as lost. Call on the driver's loop."""
        self._lose(replica, WorkerLostError(why))

    def _any_taking_rows(self) -> bool:
        return any(self._takes_rows(r) for r in range(len(self.rows)))

    def _takes_rows(self, replica: int) -> bool:
        if self._health is None:
            return True  # fail-stop: a lost replica's rows fail in _dispatch, as they did
        return self._lost[replica] is None and self._health.takes_rows(replica)

    def _no_replica_serves(self) -> None:
        """Fail every call waiting for a replica: none takes rows now."""
        assert self._health is not None
        metrics = self._health.metrics()
        error = NoReplicaServingError(
            f"no replica of the fleet serves: {metrics['fleet_replicas_dead']} dead, "
            f"{metrics['fleet_replicas_restarting'] + metrics['fleet_replicas_stale']} being "
            f"replaced, {self._health.restarts_left} restart(s) left "
            "(vllm_cfg.max_replica_restarts); retry once a replacement serves"
        )
        failed: list[tuple[_Call, Delivery | BaseException]] = []
        while self._queued:
            call = self._queued.popleft()
            call.waiting.clear()
            failed.append((call, error))
        _hand_over(failed)

    async def _watch(self) -> None:
        """Every so often: a replica that holds rows and has sent nothing for the wedge bound
        is lost; for half of it, suspect."""
        assert self._health is not None
        health = self._health
        loop = asyncio.get_running_loop()
        period = min(1.0, self._wedge_s / 4)
        last = loop.time()
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            if now - last > 2 * period + 1.0:
                # this process was not scheduled for a while (stopped, suspended): what the
                # replicas sent meanwhile is unread, so no silence of theirs can be told apart
                self._progress = [now] * len(self._progress)
            last = now
            for replica in range(len(self.rows)):
                if not self._takes_rows(replica):
                    continue
                if self.rows[replica] == 0 or self.paused:
                    self._progress[replica] = now
                    continue
                idle = now - self._progress[replica]
                if idle > self._wedge_s:
                    self._lose(
                        replica,
                        WorkerLostError(
                            f"replica {replica} held {self.rows[replica]} row(s) and made no "
                            f"progress for {idle:.1f} s (vllm_cfg.wedge_timeout_s = "
                            f"{self._wedge_s:g}): wedged, killed"
                        ),
                    )
                elif idle > self._wedge_s / 2 and health.state(replica) is ReplicaState.SERVING:
                    health.move(replica, ReplicaState.SUSPECT, f"no progress for {idle:.1f} s")

    def _fail_rows(self, replica: int, request_ids: list[str], error: GenerationError) -> None:
        failed = []
        for request_id in request_ids:
            route = self._routes.pop(request_id, None)
            if route is None:
                continue
            call = route[0]
            _, _, cost = call.live.pop(request_id)
            self._untake(replica, cost)
            failed.append((call, error))
        _hand_over(failed)
        if failed:
            self._dispatch()

    @staticmethod
    def _on(call: _Call, request_id: str, replica: int) -> bool:
        placed = call.live.get(request_id)
        return placed is not None and placed[1] == replica

    # ---- load ------------------------------------------------------------------------------

    def _pick(self, session: str | None) -> int | None:
        """The replica for a row of ``session`` (None: no session), or None when all are full."""
        least = self._least_loaded()
        if least is None or session is None:
            return least
        home = self._homes.pop(session, None)
        stays = (
            home is not None
            and self.rows[home] < self._capacity
            and self._lost[home] is None
            and self.outstanding[home] <= 2 * self.outstanding[least] + AFFINITY_SLACK_TOKENS
        )
        replica = home if stays and home is not None else least
        self._homes[session] = replica
        if len(self._homes) > MAX_SESSIONS:
            self._homes.popitem(last=False)
        return replica

    def _least_loaded(self) -> int | None:
        free = [
            r
            for r in range(len(self.rows))
            if self.rows[r] < self._capacity and self._takes_rows(r)
        ]
        return min(free, key=lambda r: (self.outstanding[r], self.rows[r], r)) if free else None

    def _take(self, replica: int, cost: int) -> None:
        if self.rows[replica] == 0:  # the wedge clock starts when a replica gets rows
            self._progress[replica] = asyncio.get_running_loop().time()
        self.rows[replica] += 1
        self.outstanding[replica] += cost

    def _untake(self, replica: int, cost: int) -> None:
        self.rows[replica] -= 1
        self.outstanding[replica] -= cost


def _row_lost(rows: list[int], replica: int, error: GenerationError) -> RowLostError:
    return RowLostError(
        f"row(s) {rows} had already streamed tokens when replica {replica} was lost ({error}): "
        "their tokens so far stand, the rest cannot be made elsewhere without contradicting "
        "them; run those rows again (the same seed gives the same tokens)",
        tuple(rows),
    )


def _timed_out(timeout_s: float, unfinished: int, total: int) -> GenerationError:
    return GenerationError(
        f"generate did not finish within {timeout_s:g} s ({unfinished} of {total} rows "
        "unfinished; vllm_cfg.generate_timeout_s sets the limit)"
    )


def _on(loop: asyncio.AbstractEventLoop, work: Callable[[], None]) -> None:
    """Run ``work`` on ``loop``: now when already there, else as soon as the loop can."""
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is loop:
        work()
    else:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs there
            loop.call_soon_threadsafe(work)


def _hand_over(items: Sequence[tuple[_Call, Delivery | BaseException]]) -> None:
    """Put each item in its call's inbox, with one hand-over per caller's loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Call, Delivery | BaseException]]] = {}
    for call, item in items:
        if not call.over:
            by_loop.setdefault(call.caller, []).append((call, item))
    for loop, pairs in by_loop.items():
        _on(loop, functools.partial(_put_all, pairs))


def _put_all(pairs: list[tuple[_Call, Delivery | BaseException]]) -> None:
    for call, item in pairs:
        call.inbox.put_nowait(item)


def _log_unexpected(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("adding rows failed unexpectedly", exc_info=task.exception())
