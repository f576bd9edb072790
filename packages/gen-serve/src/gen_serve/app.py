"""``build_app``: the FastAPI application of one backend."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from gen_interface import GenerationInterface

from gen_serve.codec import TextCodec
from gen_serve.errors import install_error_handlers
from gen_serve.guard import RequestGuard
from gen_serve.metrics import ServerMetrics
from gen_serve.routes_control import control_router, weight_router
from gen_serve.routes_info import info_router
from gen_serve.routes_openai import openai_router
from gen_serve.routes_tokens import token_router
from gen_serve.runner import Runner
from gen_serve.state import ServerSettings, ServerState

__all__ = ["build_app", "sampling_defaults"]

#: Routes an API key does not guard.
_OPEN = frozenset({"/health"})
#: Routes served while the server drains: its health, its metrics, and ending requests.
_WHILE_DRAINING = frozenset({"/health", "/metrics", "/abort_requests"})


def build_app(
    backend: GenerationInterface,
    settings: ServerSettings,
    *,
    codec: TextCodec | None = None,
    shutdown_backend: bool = True,
) -> FastAPI:
    """A server for ``backend``.

    Args:
        backend: any ``GenerationInterface`` (``generate_stream`` serves every request).
        settings: how the server behaves.
        codec: the model's tokenizer; default: read from ``settings.model_path`` when it has
            one (without it only token-id routes work).
        shutdown_backend: shut the backend down when the server stops.

    The server drains (``ServerState.begin_draining``: new requests get 503 at once) from the
    moment its shutdown begins: the lifespan's shutdown, or earlier where the host calls it
    (``gen-serve`` does on SIGTERM, before waiting for the requests in flight).
    """
    if codec is None and (Path(settings.model_path) / "tokenizer.json").is_file():
        codec = TextCodec.from_model_dir(settings.model_path)
    metrics = ServerMetrics(settings.model_name, backend.get_logger_metrics)
    state = ServerState(
        settings=settings,
        backend=backend,
        codec=codec,
        metrics=metrics,
        runner=Runner(backend, codec, metrics, max_requests=settings.max_requests),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        yield
        state.runner.drain()  # on the loop: requests held by /pause wake to their 503
        for task in list(state.requests.values()):
            task.cancel()
        metrics.close()
        if shutdown_backend:
            backend.shutdown()

    app = FastAPI(title="gen-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    install_error_handlers(app)
    app.include_router(info_router(state))
    app.include_router(openai_router(state))
    app.include_router(token_router(state))
    if settings.control_routes:
        app.include_router(control_router(state))
    if settings.weight_routes:
        app.include_router(weight_router(state))

    app.add_middleware(
        RequestGuard,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        open_paths=_OPEN,
        draining=lambda: state.draining,
        draining_paths=_WHILE_DRAINING,
    )
    return app


def sampling_defaults(model_path: str) -> dict[str, Any]:
    """The sampling defaults of a model's ``generation_config.json`` (vLLM applies them to
    fields a request leaves out), over vLLM's own defaults."""
    defaults: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
    path = Path(model_path) / "generation_config.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        for key in defaults:
            if isinstance(saved.get(key), int | float) and not isinstance(saved.get(key), bool):
                defaults[key] = saved[key]
    if defaults["top_k"] == 0:
        defaults["top_k"] = -1
    return defaults
