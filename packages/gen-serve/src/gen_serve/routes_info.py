"""``/health``, ``/v1/models``, ``/version`` and ``/metrics``."""

from __future__ import annotations

import time
import uuid
from importlib.metadata import version
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from gen_serve.state import ServerState

__all__ = ["info_router"]


def info_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        """200 while the backend can generate or is asleep by request; 503 once it is broken
        or shut down (every call would fail)."""
        unusable = state.backend.state in ("broken", "shut down")
        return Response(status_code=503 if unusable else 200)

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

    @router.get("/metrics")
    async def metrics() -> Response:
        state.metrics.weight_version.set(state.backend.weight_version)
        state.metrics.waiting.set(0 if state.runner.admitting.is_set() else state.runner.in_flight)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    return router
