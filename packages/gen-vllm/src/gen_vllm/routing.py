"""Routed experts read inside a vLLM worker (``return_routed_experts``), per request.

vLLM's own ``enable_return_routed_experts`` needs its Model Runner V2, which needs Triton, which
the CPU build lacks. So the worker reads the routing itself: every MoE layer's router
(``MoERunner.router``, a ``BaseRouter``) calls a capture function with the top-k expert ids of
each forward's tokens (``[tokens, top_k]``), and a wrapper around the model runner's
``execute_model`` splits each forward's tokens per request: the runner lays them out in
``input_batch.req_ids`` order, each request's ``num_scheduled_tokens`` from position
``num_computed_tokens``. Each request's routing is kept by position, so a request recomputed
after preemption (or after a paused update) overwrites what it read before.

Only an eager model calls the capture function (a compiled or CUDA-graph forward was traced
without it). On a GPU with ``enforce_eager`` off, vLLM's own ``enable_return_routed_experts``
(Model Runner V2, Triton) returns each finished request's routing instead, in the same layout;
on CPU, ``return_routed_experts`` without ``enforce_eager`` is refused. Requests
must not read the prefix cache (``skip_reading_prefix_cache``): a cached position is never fed,
so it would have no routing. Speculative decoding is refused (draft tokens are fed, then
rejected).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

__all__ = [
    "WIRE_DTYPES",
    "RoutingCapture",
    "moe_runners",
    "moe_shape",
    "read_routing",
    "to_wire",
    "wire_dtype",
]

#: The dtypes routing crosses process boundaries in: one byte while every id and the "not read"
#: mark fit (as prime-rl sends it), else two.
WIRE_DTYPES = {"uint8": np.uint8, "int16": np.int16}
_UNREAD_UINT8 = 255  # a position not read, in uint8 (-1 in int16)


def wire_dtype(num_experts: int) -> str:
    return "uint8" if num_experts < _UNREAD_UINT8 else "int16"


def read_routing(blob: bytes | None, shape: tuple[int, int, int]) -> torch.Tensor | None:
    """A request's routing from the wire: int16 ``[positions, layers, top_k]``, -1 where a
    position was not read, for ``shape`` = ``(layers, top_k, experts)``; None for none."""
    if blob is None:
        return None
    layers, top_k, experts = shape
    array = np.frombuffer(blob, dtype=WIRE_DTYPES[wire_dtype(experts)]).astype(np.int16)
    if wire_dtype(experts) == "uint8":
        array[array == _UNREAD_UINT8] = -1
    return torch.from_numpy(array).reshape(-1, layers, top_k)


def moe_runners(model_runner: Any) -> list[Any]:
    """The MoE layers (``MoERunner``) of a vLLM model runner's model, in model order.

    Raises:
        ValueError: there is none, or one routes inside a fused kernel (no capture function).
    """
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    moe = [m for m in model_runner.get_model().modules() if isinstance(m, MoERunner)]
    if not moe:
        raise ValueError("the model has no MoE layer")
    moe.sort(key=lambda m: m.layer_id)  # the decoder layer's index
    bad = [m.layer_name for m in moe if m.is_monolithic or not isinstance(m.router, BaseRouter)]
    if bad:
        raise ValueError(f"MoE layer {bad[0]} routes inside a fused kernel: no capture")
    return moe


def moe_shape(model_runner: Any, moe: list[Any] | None = None) -> tuple[int, int, int]:
    """``(MoE layers, top_k, experts per layer)`` of a model runner's model, from its MoE layers
    ``moe`` (default: ``moe_runners``)."""
    routers: list[Any] = [m.router for m in (moe if moe is not None else moe_runners(model_runner))]
    experts = max(int(router.global_num_experts) for router in routers)
    return len(routers), int(routers[0].top_k), experts


def to_wire(ids: np.ndarray, num_experts: int) -> bytes:
    """``[positions, layers, top_k]`` ids (-1: not read) in the wire dtype, as bytes."""
    if wire_dtype(num_experts) == "uint8":
        return np.where(ids < 0, _UNREAD_UINT8, ids).astype(np.uint8).tobytes()
    return ids.astype(np.int16).tobytes()  # vLLM's own arrays may be uint16 or int32


class RoutingCapture:
    """Reads the routing of every forward of ``model_runner`` (a vLLM v1 model runner).

    Attributes:
        layers, top_k, experts: MoE layers (in model order), experts per token, experts per
            layer.

    Raises:
        ValueError: the model has no MoE layer, a layer's router cannot take a capture
            function, or the runner compiles its forward or decodes speculatively.
    """

    def __init__(self, model_runner: Any):
        from vllm.config import CompilationMode

        runner = model_runner
        moe = moe_runners(runner)
        if runner.vllm_config.compilation_config.mode != CompilationMode.NONE:
            raise ValueError("the forward is compiled (set vllm_cfg.enforce_eager to true)")
        if runner.speculative_config is not None:
            raise ValueError("speculative decoding feeds draft tokens it may reject")
        routers: list[Any] = [m.router for m in moe]
        self.layers, self.top_k, self.experts = moe_shape(runner, moe)
        self._runner = runner
        self._forward: dict[int, Any] = {}  # layer slot -> [tokens, top_k] of this forward
        self._rows: dict[str, np.ndarray] = {}  # request -> int16 [capacity, layers, top_k]
        self._filled: dict[str, int] = {}  # request -> positions read
        for slot, router in enumerate(routers):
            router.set_capture_fn(functools.partial(self._keep, slot))
        run_model = runner.execute_model

        @functools.wraps(run_model)
        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._forward.clear()
            out = run_model(scheduler_output, *args, **kwargs)
            if self._forward:
                self._split(scheduler_output)
            return out

        runner.execute_model = execute_model  # an instance attribute: shadows the method

    def _keep(self, slot: int, topk_ids: Any) -> None:
        self._forward[slot] = topk_ids.detach().to("cpu", copy=True)

    def _split(self, scheduler_output: Any) -> None:
        count = int(scheduler_output.total_num_scheduled_tokens)
        if len(self._forward) != self.layers:
            raise RuntimeError(
                f"{len(self._forward)} of {self.layers} MoE layers reported their routing in "
                "one forward"
            )
        stacked = torch.stack([self._forward[s] for s in range(self.layers)], dim=1)[:count]
        ids = stacked.numpy().astype(np.int16)  # [tokens, layers, top_k]
        batch, offset = self._runner.input_batch, 0
        for index, request in enumerate(batch.req_ids[: batch.num_reqs]):
            scheduled = int(scheduler_output.num_scheduled_tokens.get(request, 0))
            if scheduled:
                start = int(batch.num_computed_tokens_cpu[index])
                self._write(request, start, ids[offset : offset + scheduled])
                offset += scheduled
        self._forward.clear()

    def _write(self, request: str, start: int, ids: np.ndarray) -> None:
        end = start + ids.shape[0]
        row = self._rows.get(request)
        if row is None or row.shape[0] < end:
            capacity = max(end, 2 * (0 if row is None else row.shape[0]))
            grown = np.full((capacity, *ids.shape[1:]), -1, dtype=np.int16)
            if row is not None:
                grown[: row.shape[0]] = row
            row = self._rows[request] = grown
        row[start:end] = ids
        self._filled[request] = end if start == 0 else max(self._filled.get(request, 0), end)

    def take(self, request_ids: list[str]) -> dict[str, bytes]:
        """Hand over (and forget) the routing of the given requests, by the id the engine was
        given: ``[positions, layers, top_k]`` up to the last position read, in the wire dtype,
        as bytes (absent for a request that read nothing)."""
        wanted = set(request_ids)
        out: dict[str, bytes] = {}
        for internal in [r for r in self._rows if _external_id(r) in wanted]:
            filled = self._filled.pop(internal)
            row = self._rows.pop(internal)[:filled]
            out[_external_id(internal)] = to_wire(row, self.experts)
        return out


def _external_id(internal: str) -> str:
    """The id a request was added with: the engine appends ``-<8 random characters>``."""
    return internal.rsplit("-", 1)[0]
