"""Running one request's rows on the backend: admission, streaming, cancellation, metrics.

Every request is one ``generate_stream`` call, so requests run concurrently and a short one is
never held behind a long one; closing a request's stream (a client that went away) ends its
rows in the backend. The number of requests in flight is bounded: past the limit the server
answers 503 at once, so a burst cannot grow memory without bound. Once the server drains
(``drain``: it is shutting down) new requests, and requests held at the door by ``/pause``, get
503 at once; requests already generating go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gen_interface import GenerationInterface, RowEvent

from gen_serve.codec import TextCodec
from gen_serve.errors import ApiError
from gen_serve.metrics import ServerMetrics
from gen_serve.rows import RowPlan

__all__ = [
    "DRAINING_MESSAGE",
    "RETRY_DRAINING_S",
    "RETRY_FULL_S",
    "RowOutcome",
    "RowStream",
    "Runner",
    "until_disconnected",
]

#: What a request that comes while the server shuts down is told.
DRAINING_MESSAGE = (
    "the server is shutting down and takes no new requests; send this one to another server, "
    "or retry once this one is back"
)
#: ``Retry-After`` seconds: a full server frees a slot soon; a draining one is going away.
RETRY_FULL_S = 1
RETRY_DRAINING_S = 5


@dataclass
class RowOutcome:
    """One row: what it generated and how it ended (``finish_reason`` None while it runs)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_version: int = 0
    weight_versions: list[int] = field(default_factory=list)
    # int16 [prompt + generated - 1, layers, top_k] when the backend returns routed experts
    routed_experts: Any = None

    def take(self, event: RowEvent) -> None:
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        self.topk_ids.extend(event.topk_ids)
        self.topk_logprobs.extend(event.topk_logprobs)


@dataclass(frozen=True)
class RowStream:
    """One step of a request: row ``row`` got ``event``; ``outcome`` holds it all so far."""

    row: int
    event: RowEvent
    outcome: RowOutcome


class Runner:
    """The backend, and the rules every request goes through.

    Args:
        backend: any ``GenerationInterface``.
        codec: the model's tokenizer (stop strings are found in text with it).
        metrics: where counts and times go.
        max_requests: requests in flight at most; more are refused with 503.
    """

    def __init__(
        self,
        backend: GenerationInterface,
        codec: TextCodec | None,
        metrics: ServerMetrics,
        *,
        max_requests: int,
    ):
        self.backend = backend
        self.codec = codec
        self.metrics = metrics
        self.max_requests = max_requests
        self.in_flight = 0
        #: Requests held at the door while the server is paused (``/pause``).
        self.admitting = asyncio.Event()
        self.admitting.set()
        #: The server is shutting down: no request starts any more (``drain``).
        self.draining = False
        #: ``with_sampling`` front ends by staleness bound (``RowExtras.max_weight_staleness``).
        self._front_ends: dict[int, GenerationInterface] = {}

    async def stream(self, plan: RowPlan) -> AsyncIterator[RowStream]:
        """Every event of ``plan``'s rows as it comes; each row's last has its outcome final.

        Raises:
            ApiError: 503 when too many requests are in flight, or the server drains.
            GenerationError: the backend refused or failed the call.
        """
        self._refuse_if_draining()
        if self.in_flight >= self.max_requests:
            self.metrics.rejected()
            raise ApiError(
                503,
                f"the server has {self.in_flight} requests in flight, its limit "
                "(--max-requests); retry later",
                retry_after=RETRY_FULL_S,
            )
        self.in_flight += 1
        started = time.perf_counter()
        first_token: float | None = None
        outcomes = [RowOutcome() for _ in range(plan.rows)]
        self.metrics.request_started(sum(len(p) for p in plan.prompts))
        finished = False
        try:
            await self.admitting.wait()
            self._refuse_if_draining()
            events = self._bounded(plan.max_weight_staleness).generate_stream(plan.batch)
            try:
                async for event in events:
                    outcome = outcomes[event.index]
                    outcome.take(event)
                    if event.token_ids and first_token is None:
                        first_token = time.perf_counter()
                        self.metrics.first_token(first_token - started)
                    if event.output is not None:
                        self._finish(plan, event.index, outcome, event.output)
                    yield RowStream(event.index, event, outcome)
            finally:
                await events.aclose()
            finished = True
        finally:
            self.in_flight -= 1
            self.metrics.request_ended(
                time.perf_counter() - started,
                sum(len(o.token_ids) for o in outcomes),
                [o.finish_reason or "abort" for o in outcomes] if finished else ["abort"],
            )

    def drain(self) -> None:
        """The server is shutting down: refuse new requests, and release those held by
        ``/pause`` with the same 503. Call on the server's event loop."""
        self.draining = True
        self.admitting.set()

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise ApiError(503, DRAINING_MESSAGE, retry_after=RETRY_DRAINING_S)

    def _bounded(self, max_staleness: int | None) -> GenerationInterface:
        """The backend, or its front end with the request's staleness bound."""
        if max_staleness is None:
            return self.backend
        if max_staleness not in self._front_ends:
            try:
                view = self.backend.with_sampling(max_weight_staleness=max_staleness)
            except NotImplementedError as exc:
                raise ApiError(
                    400,
                    f"extra_args.max_weight_staleness needs a backend with front ends: {exc}",
                    "sampling_params.extra_args.max_weight_staleness",
                ) from exc
            self._front_ends[max_staleness] = view
        return self._front_ends[max_staleness]

    async def run(self, plan: RowPlan) -> list[RowOutcome]:
        """Every row of ``plan`` to its end."""
        outcomes: list[RowOutcome] = [RowOutcome() for _ in range(plan.rows)]
        async for step in self.stream(plan):
            outcomes[step.row] = step.outcome
        return outcomes

    def _finish(self, plan: RowPlan, row: int, outcome: RowOutcome, output: Any) -> None:
        outcome.weight_version = int(output["weight_version"][0])
        start = int(output["unpadded_sequence_lengths"][0] - output["generation_lengths"][0])
        outcome.weight_versions = output["weight_versions"][0, start:].tolist()
        if "routed_experts" in output:  # every position the model read: all but the last
            read = int(output["unpadded_sequence_lengths"][0]) - 1
            outcome.routed_experts = output["routed_experts"][0, :read].numpy()
        if bool(output["truncated"][0]):
            outcome.finish_reason = "length"
        elif bool(output["cut_short"][0]):
            outcome.finish_reason = "abort"
        else:
            outcome.finish_reason = "stop"
            outcome.stop_reason = self._stop_reason(plan, outcome.token_ids)

    def _stop_reason(self, plan: RowPlan, tokens: list[int]) -> int | str | None:
        """vLLM's ``stop_reason``: None for the end-of-sequence token, the id of another stop
        token, or the stop string that ended the row."""
        if tokens and tokens[-1] in plan.stop_token_ids:
            return None if tokens[-1] == plan.eos_token_id else tokens[-1]
        if plan.stop_strings and self.codec is not None:
            text = self.codec.decode(tokens, skip_special_tokens=False)
            found = [(text.find(s), s) for s in plan.stop_strings if s in text]
            if found:
                return min(found)[1]
        return None


async def until_disconnected(receive: Any, work: asyncio.Future[Any]) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (its rows end) and raise
    ``asyncio.CancelledError``."""

    async def watch() -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await work
        raise asyncio.CancelledError("the client disconnected")
    finally:
        watcher.cancel()
