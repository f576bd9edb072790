"""``/health``, ``/v1/models``, ``/version``, ``/metrics`` and this server's ``/backend_info``."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import time
import uuid
from importlib.metadata import version
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from gen_serve.health import health_answer
from gen_serve.state import ServerState

__all__ = ["info_router"]

logger = logging.getLogger(__name__)


def info_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        """200 while the backend can generate or is asleep by request (a JSON body saying
        ``degraded`` when some replica of its fleet is not serving, else empty, as vLLM's);
        503 while the server drains, once the backend is broken or shut down, or while no
        replica of its fleet takes rows (``gen_serve.health``)."""
        metrics: dict[str, int | float] | None = None
        error: str | None = None
        if not state.draining:
            try:
                metrics = await state.metrics.read_backend()
            except TimeoutError:
                error = f"no answer within {state.metrics.read_timeout_s} s"
            except Exception as exc:  # the backend's own failure, reported in the answer
                error = f"{type(exc).__name__}: {exc}"
        answer = health_answer(
            draining=state.draining,
            backend_state=state.backend.state,
            metrics=metrics,
            metrics_error=error,
        )
        if answer.body is None:
            return Response(status_code=answer.status)
        return JSONResponse(answer.body, status_code=answer.status)

    @router.get("/v1/models")
    async def models() -> Any:
        now = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": state.settings.model_name,
                    "object": "model",
                    "created": now,
                    "owned_by": "gen-serve",
                    "root": state.settings.model_path,
                    "parent": None,
                    "max_model_len": state.context_limit,
                    "permission": [
                        {
                            "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                            "object": "model_permission",
                            "created": now,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }

    @router.get("/version")
    async def server_version() -> Any:
        return {"version": version("gen-serve"), "backend": state.backend.config["backend"]}

    @router.get("/backend_info")
    async def backend_info() -> Any:
        """What a client of this project (the ``remote`` backend) needs to act as the backend
        itself: its config, capabilities, limits, weight version and the host it runs on."""
        backend = state.backend
        limits = [state.settings.max_logprobs, getattr(backend, "max_top_logprobs", None)]
        return {
            "backend": backend.config["backend"],
            "model_name": state.settings.model_name,
            "host": socket.gethostname(),
            "config": json.loads(json.dumps(dict(backend.config), default=str)),
            "capabilities": _plain(dataclasses.asdict(backend.capabilities)),
            "vocab_size": getattr(backend, "vocab_size", None),
            "context_limit": state.context_limit,
            "max_top_logprobs": min(x for x in limits if x is not None),
            "eos_token_id": state.eos_token_id,
            "has_tokenizer": state.codec is not None,
            "control_routes": state.settings.control_routes,
            "weight_routes": state.settings.weight_routes,
            "weight_deltas": state.settings.weight_routes,  # /weight_base is served
            "weight_version": backend.weight_version,
            "state": backend.state,
            # (MoE layers, top_k) when every row's choice carries its routed experts
            "routed_experts": getattr(backend, "routing", None),
        }

    @router.get("/metrics")
    async def metrics() -> Response:
        """The server's metrics and the backend's ``get_logger_metrics()`` (read off the event
        loop; left out, with a warning in the log, when the read fails or takes too long)."""
        state.metrics.weight_version.set(state.backend.weight_version)
        state.metrics.waiting.set(0 if state.runner.admitting.is_set() else state.runner.in_flight)
        try:
            backend = await state.metrics.read_backend()
        except TimeoutError:
            logger.warning(
                "/metrics: the backend's get_logger_metrics gave no answer within %s s; its "
                "values are left out of this scrape",
                state.metrics.read_timeout_s,
            )
            backend = {}
        except Exception:
            logger.exception("/metrics: the backend's get_logger_metrics failed; left out")
            backend = {}
        return Response(state.metrics.render(backend), media_type="text/plain; version=0.0.4")

    return router


def _plain(value: Any) -> Any:
    """``value`` as JSON: sets become sorted lists, tuples lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, frozenset | set):
        return sorted(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value
