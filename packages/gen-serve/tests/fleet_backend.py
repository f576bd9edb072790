"""An n-gram backend with a fleet, and an in-process client of a gen-serve app over it: what the
health, fleet-metrics, fleet-error and draining tests need, with no engine to start.

``FleetNgram`` reports a real ``FleetHealth``'s metrics (the kit's state machine, as gen-vllm's
fleet does) beside the n-gram backend's own, and raises the fleet's errors when told to.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI
from gen_backend_kit.fleet_health import FleetHealth
from gen_interface import BatchedDataDict, GenerationError, RowEvent, RowLostError
from gen_serve import ServerSettings, build_app
from gen_testkit.conformance import conformance_config
from gen_testkit.ngram import NgramGeneration

__all__ = ["FleetNgram", "client_of", "ngram_app", "ngram_config"]

VOCAB = 64
#: The longest ``get_logger_metrics`` waits on ``metrics_gate``.
GATE_S = 30.0


def ngram_config() -> dict[str, Any]:
    config = conformance_config(backend="ngram", model_name="ngram", vocab_size=VOCAB)
    return dict(config, ngram={"vocab_size": VOCAB, "order": 2})


class FleetNgram(NgramGeneration):
    """The n-gram backend as if it ran ``replicas`` replicas, all serving at first.

    Attributes:
        fleet: the fleet's health; tests move its replicas between states.
        refuse: raised by ``generate_stream`` before any token (None: generate).
        lose_row_after: raise ``RowLostError`` for the row whose token brings the call's
            streamed tokens to this many (None: never).
        metrics_gate: when set, ``get_logger_metrics`` waits until it is set (at most
            ``GATE_S``: a test that forgets it fails rather than hangs).
        metrics_threads: the names of the threads ``get_logger_metrics`` ran on.
        draining_at_shutdown: what the server's ``draining`` was when ``shutdown`` came.
    """

    def __init__(self, replicas: int = 2, max_restarts: int = 4):
        super().__init__(ngram_config())  # type: ignore[arg-type]
        self.fleet = FleetHealth(replicas, max_restarts=max_restarts)
        self.refuse: GenerationError | None = None
        self.lose_row_after: int | None = None
        self.metrics_gate: threading.Event | None = None
        self.metrics_threads: set[str] = set()
        self.server: Any = None
        self.draining_at_shutdown: bool | None = None

    def get_logger_metrics(self) -> dict[str, int | float]:
        self.metrics_threads.add(threading.current_thread().name)
        if self.metrics_gate is not None:
            self.metrics_gate.wait(GATE_S)
        return {**super().get_logger_metrics(), **self.fleet.metrics()}

    async def generate_stream(
        self, data: BatchedDataDict[Any], greedy: bool = False
    ) -> AsyncGenerator[RowEvent, None]:
        if self.refuse is not None:
            raise self.refuse
        streamed = 0
        events = super().generate_stream(data, greedy)
        try:
            async for event in events:
                yield event
                streamed += len(event.token_ids)
                if self.lose_row_after is not None and streamed >= self.lose_row_after:
                    raise RowLostError(
                        f"row {event.index} had streamed {streamed} tokens on replica 0, which "
                        "died; run it again",
                        rows=(event.index,),
                    )
        finally:
            await events.aclose()

    def shutdown(self) -> None:
        if self.server is not None:
            self.draining_at_shutdown = getattr(self.server, "draining", None)
        super().shutdown()


def ngram_app(backend: NgramGeneration, **settings: Any) -> FastAPI:
    """A gen-serve app over ``backend`` (no tokenizer: token-id prompts only)."""
    app = build_app(
        backend, ServerSettings(model_name="ngram", model_path="ngram", **settings), codec=None
    )
    if isinstance(backend, FleetNgram):
        backend.server = app.state.server
    return app


@contextlib.asynccontextmanager
async def client_of(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of ``app`` in this event loop, with no socket."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gen-serve") as client:
        yield client
