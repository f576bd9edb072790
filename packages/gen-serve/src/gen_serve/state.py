"""What a running server holds: its settings, the backend, the tokenizer, and request helpers."""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass, field
from importlib.metadata import version as _version
from typing import Any, TypeVar

from fastapi import Request
from gen_interface import GenerationInterface
from pydantic import BaseModel, ValidationError

from gen_serve.codec import TextCodec
from gen_serve.errors import ApiError
from gen_serve.metrics import ServerMetrics
from gen_serve.runner import Runner

__all__ = ["ServerSettings", "ServerState", "parse_body"]

ModelT = TypeVar("ModelT", bound=BaseModel)


@dataclass(frozen=True)
class ServerSettings:
    """How the server behaves.

    Attributes:
        model_name: the name clients use (``model``), default the model path.
        model_path: the model directory (its tokenizer and generation config).
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <key>``.
        max_requests: requests in flight at most; more get 503.
        max_rows_per_request: prompts x n of one request at most; more get 400.
        max_body_bytes: the largest request body; larger get 413.
        max_logprobs: the most top logprobs a request may ask for (vLLM's default, 20).
        control_routes: serve ``/pause``, ``/resume``, ``/sleep``, ... (on by default).
        weight_routes: serve the weight-update routes (on by default).
        defaults: sampling values for fields a request leaves out (the model's generation
            config's, else vLLM's): ``temperature``, ``top_p``, ``top_k``, ``min_p``.
    """

    model_name: str
    model_path: str
    api_key: str | None = None
    max_requests: int = 1024
    max_rows_per_request: int = 1024
    max_body_bytes: int = 32 << 20
    max_logprobs: int = 20
    control_routes: bool = True
    weight_routes: bool = True
    defaults: dict[str, Any] = field(
        default_factory=lambda: {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
    )


@dataclass
class ServerState:
    """One server's backend, tokenizer, runner and the state of its control routes."""

    settings: ServerSettings
    backend: GenerationInterface
    codec: TextCodec | None
    metrics: ServerMetrics
    runner: Runner
    #: Requests in flight by id (``/abort_requests`` cancels them).
    requests: dict[str, asyncio.Task[Any]] = field(default_factory=dict)
    #: ``/pause`` opened a weight transaction to hold running rows.
    paused_update: bool = False
    sleeping: bool = False
    update_started: float | None = None
    #: The version the open update commits (``/start_weight_update`` answers it).
    update_target: int | None = None
    #: The event loop that serves the requests, known once the server has started.
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def draining(self) -> bool:
        """The server is shutting down (``begin_draining``)."""
        return self.runner.draining

    def begin_draining(self) -> None:
        """The server is shutting down: from now on ``/health`` answers 503, every request but
        ``/health``, ``/metrics`` and ``/abort_requests`` gets 503 at once (with
        ``Retry-After``), and so do requests held by ``/pause``; requests already generating go
        on. Safe to call from any thread and from a signal handler; calling it again does
        nothing more."""
        self.runner.draining = True  # the guard and new requests see it at once
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.runner.drain)  # wakes the requests held by /pause
        else:
            self.runner.drain()

    @functools.cached_property
    def fingerprint(self) -> str:
        """The ``system_fingerprint`` of responses: this server's version and its backend."""
        return f"gen-serve-{_version('gen-serve')}-{self.backend.config['backend']}"

    @property
    def context_limit(self) -> int | None:
        return getattr(self.backend, "context_limit", None)

    @property
    def eos_token_id(self) -> int | None:
        ids = self.backend.config.get("stop_token_ids") or []
        if self.codec is not None and self.codec.eos_token_id is not None:
            return self.codec.eos_token_id
        return ids[0] if ids else None

    def require_codec(self, what: str) -> TextCodec:
        if self.codec is None:
            raise ApiError(
                400, f"{what} needs the model's tokenizer (tokenizer.json), which it lacks"
            )
        return self.codec

    def check_model(self, model: str | None) -> None:
        if model not in (None, "", self.settings.model_name, self.settings.model_path):
            raise ApiError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {self.settings.model_name}.",
                "model",
            )


async def parse_body(request: Request, model: type[ModelT], *, empty_ok: bool = False) -> ModelT:
    """The request's JSON body as ``model``; a 400 (or 413) saying what is wrong otherwise."""
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    body = await request.body()
    server = getattr(request.app.state, "server", None)
    limit = server.settings.max_body_bytes if server is not None else None
    if limit is not None and len(body) > limit:
        raise ApiError(413, f"the body is {len(body)} bytes; this server takes at most {limit}")
    if not body and empty_ok:
        return model.model_validate({})
    if kind != "application/json":
        raise ApiError(
            400, f"Unsupported Media Type: only 'application/json' is allowed, got {kind!r}"
        )
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        errors = exc.errors()
        first = ".".join(str(p) for p in errors[0]["loc"]) if errors and errors[0]["loc"] else None
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:10]
        )
        raise ApiError(400, f"{len(errors)} validation error(s): {detail}", first) from exc
