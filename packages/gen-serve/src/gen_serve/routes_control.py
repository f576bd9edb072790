"""vLLM's RL routes (pause, resume, sleep, weights, ...), mapped onto this project's interface.

A weight update is one transaction: ``/start_weight_update`` opens it, each ``/update_weights``
is one load (shared-memory handles on this machine, or a broadcast over the weight group joined
with ``/init_weight_transfer_engine``; either may carry deltas against the base ``/weight_base``
describes), ``/finish_weight_update`` commits it (verified, with the
version it names) and ``/abort_weight_update`` drops it. ``/pause?mode=keep|abort`` opens the
transaction at once, so running rows hold (``keep``) or end cut short (``abort``) exactly as an
update in flight makes them; ``mode=wait`` first lets requests in flight finish. ``/resume``
after a pause without a finish drops the transaction: rows resume as they were when nothing was
written, and end cut short when something was (no token comes from mixed weights).
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Literal

import torch
from fastapi import APIRouter, Query, Request
from gen_interface import WeightUpdateError
from gen_interface.weights import handles_from_json
from gen_interface.weights.handles import dtype_from_name
from pydantic import Field

from gen_serve.errors import ApiError
from gen_serve.protocol import _Strict
from gen_serve.state import ServerState, parse_body

__all__ = ["control_router", "weight_router"]


class _AbortRequests(_Strict):
    request_ids: list[str] = Field(default_factory=list)


class _StartUpdate(_Strict):
    version: int | None = Field(None, ge=0)
    in_flight: Literal["keep", "abort"] = "keep"


class _UpdateWeights(_Strict):
    update_info: dict[str, Any] | list[dict[str, Any]]


class _FinishUpdate(_Strict):
    weight_version: str | int | None = None


class _InitTransfer(_Strict):
    init_info: dict[str, Any]


class _NewVersion(_Strict):
    new_version: str | int


class _RefitInfo(_Strict):
    state_dict_info: dict[str, tuple[list[int], str]]


class _Announce(_Strict):
    version: int = Field(..., ge=0)


def _blocking(state: ServerState, call: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a backend call off the event loop (weight writes, sleeping and waking block)."""
    return asyncio.to_thread(call, *args, **kwargs)


def control_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    runner = state.runner

    @router.post("/pause")
    async def pause(mode: Literal["abort", "wait", "keep"] = "abort") -> Any:
        runner.admitting.clear()
        if mode == "wait":
            while runner.in_flight:
                await asyncio.sleep(0.05)
        if not state.paused_update:
            await _start(state, in_flight="keep" if mode == "wait" else mode)
            state.paused_update = True
        return {"status": "paused"}

    @router.post("/resume")
    async def resume() -> Any:
        if state.paused_update:
            state.paused_update = False
            if _update_open(state):
                await _blocking(state, state.backend.abort_weight_update)
                _update_ended(state)
        runner.admitting.set()
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused() -> Any:
        return {"is_paused": not runner.admitting.is_set()}

    @router.post("/abort_requests")
    async def abort_requests(request: Request) -> Any:
        body = await parse_body(request, _AbortRequests, empty_ok=True)
        wanted = body.request_ids or list(state.requests)
        aborted = 0
        for rid in wanted:
            task = state.requests.get(rid)
            if task is not None and not task.done():
                task.cancel()
                aborted += 1
        return {"status": "aborted", "aborted": aborted}

    @router.post("/sleep")
    async def sleep(level: Annotated[int, Query(ge=0, le=2)] = 1) -> Any:
        await _blocking(state, state.backend.finish_generation)
        state.sleeping = True
        return {"status": "sleeping", "level": level}

    @router.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Any:
        await _blocking(state, state.backend.prepare_for_generation, tags=tags)
        state.sleeping = state.backend.state == "finished"  # a part may still sleep
        return {"status": "sleeping" if state.sleeping else "awake", "tags": tags}

    @router.get("/is_sleeping")
    async def is_sleeping() -> Any:
        return {"is_sleeping": state.sleeping}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Any:
        return {"success": bool(await _blocking(state, state.backend.invalidate_kv_cache))}

    @router.get("/get_world_size")
    async def get_world_size() -> Any:
        try:
            ranks = state.backend.collective_ranks()
        except NotImplementedError:
            return {"world_size": 1}
        # vLLM's answer, and whether the weight group still holds those workers (this
        # project's, for the remote client's WeightBroadcaster: collective_intact)
        return {"world_size": ranks, "weight_group_intact": state.backend.collective_intact()}

    return router


def weight_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    backend = state.backend

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> Any:
        body = await parse_body(request, _InitTransfer)
        await _blocking(state, backend.init_collective, body.init_info)
        return {"message": "Weight transfer initialized"}

    @router.post("/start_weight_update")
    async def start_weight_update(request: Request) -> Any:
        body = await parse_body(request, _StartUpdate, empty_ok=True)
        if state.paused_update and _update_open(state):  # /pause opened it
            return {"message": "Weight update started", "weight_version": state.update_target}
        target = await _start(state, in_flight=body.in_flight, version=body.version)
        return {"message": "Weight update started", "weight_version": target}

    @router.post("/prepare_refit_info")
    async def prepare_refit_info(request: Request) -> Any:
        """This server's: check that updates carrying ``state_dict_info`` (``{name: [shape,
        dtype]}``) fit the model (``GenerationInterface.prepare_refit_info``)."""
        body = await parse_body(request, _RefitInfo)
        try:
            info = {
                name: (torch.Size(shape), dtype_from_name(dtype))
                for name, (shape, dtype) in body.state_dict_info.items()
            }
        except (WeightUpdateError, TypeError, ValueError) as exc:
            raise ApiError(400, f"state_dict_info: {exc}", "state_dict_info") from exc
        await _blocking(state, backend.prepare_refit_info, info)
        return {"message": "Weights fit the model"}

    @router.post("/update_weights")
    async def update_weights(request: Request) -> Any:
        body = await parse_body(request, _UpdateWeights)
        loads = body.update_info if isinstance(body.update_info, list) else [body.update_info]
        for load in loads:
            if "handles" in load:
                try:
                    handles = handles_from_json(load["handles"])
                except WeightUpdateError as exc:
                    raise ApiError(400, str(exc), "update_info") from exc
                await _blocking(state, backend.update_weights_from_ipc_handles, handles)
            elif "broadcast" in load:
                await _blocking(state, backend.update_weights_from_collective, load["broadcast"])
            else:
                raise ApiError(
                    400,
                    "update_info must hold `handles` (shared weights from "
                    "gen_interface.weights) or `broadcast` (a bucket of the weight group)",
                    "update_info",
                )
        return {"message": "Weights updated"}

    @router.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> Any:
        body = await parse_body(request, _FinishUpdate, empty_ok=True)
        version = _version(body.weight_version)
        try:
            committed = await _blocking(state, backend.commit_weight_update, version)
        finally:
            if not _update_open(state):
                _update_ended(state)
        state.paused_update = False
        return {"message": "Weight update finished", "weight_version": str(committed)}

    @router.post("/abort_weight_update")
    async def abort_weight_update() -> Any:
        await _blocking(state, backend.abort_weight_update)
        _update_ended(state)
        state.paused_update = False
        return {"message": "Weight update aborted"}

    @router.post("/announce_weight_version")
    async def announce_weight_version(request: Request) -> Any:
        body = await parse_body(request, _Announce)
        backend.announce_weight_version(body.version)
        return {"success": True}

    @router.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Any:
        body = await parse_body(request, _NewVersion)
        if _version(body.new_version) != backend.weight_version:
            raise ApiError(
                409,
                f"weights are labelled by the transaction that wrote them (version "
                f"{backend.weight_version} now): name the version in /finish_weight_update, or "
                "announce the trainer's with /announce_weight_version",
                "new_version",
            )
        return {"success": True, "new_version": str(backend.weight_version)}

    @router.get("/weight_info")
    async def weight_info() -> Any:
        return {"weight_version": str(backend.weight_version)}

    @router.get("/weight_base")
    async def weight_base() -> Any:
        """This server's: the committed weights its backend takes deltas against
        (``GenerationInterface.weight_base``; null: none, every tensor comes whole)."""
        return {"weight_base": await _blocking(state, backend.weight_base)}

    @router.post("/weight_checker")
    async def weight_checker() -> Any:
        raise ApiError(
            501,
            "every update here is checked as it lands (each bucket's checksum before it is "
            "written, every worker's weights after it): there is no separate checker",
        )

    return router


async def _start(state: ServerState, *, in_flight: str, version: int | None = None) -> int:
    target = await _blocking(state, state.backend.start_weight_update, version, in_flight=in_flight)
    state.update_started = time.perf_counter()
    state.update_target = int(target)
    return int(target)


def _update_open(state: ServerState) -> bool:
    return state.update_started is not None


def _update_ended(state: ServerState) -> None:
    if state.update_started is not None:
        state.metrics.update_seconds.observe(time.perf_counter() - state.update_started)
        state.update_started = None
    state.metrics.weight_version.set(state.backend.weight_version)


def _version(value: str | int | None) -> int | None:
    if value is None:
        return None
    try:
        version = int(value)
    except ValueError as exc:
        raise ApiError(
            400, f"weight versions here are integers >= 0, got {value!r}", "weight_version"
        ) from exc
    if version < 0:
        raise ApiError(400, f"weight versions are >= 0, got {version}", "weight_version")
    return version
