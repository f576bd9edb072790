"""``UpdatableVllmInternalWorker``: the vLLM worker extension (``worker_extension_cls``).

vLLM mixes this class into each of its workers; its methods run there, reached through
``collective_rpc``. Weights themselves arrive through vLLM's own weight-update transaction
(``start_weight_update`` / ``update_weights`` / ``finish_weight_update``) and this project's
transfer engine (``transfer.py``, whose module vLLM imports as the extension's). This class adds
what the driver needs around it: which device a worker is on, what an update must match, and a
report proving that every worker took the same update.

This module imports no vLLM, so test fakes can run it without the engine.
"""

from __future__ import annotations

import os
import platform
import socket
from typing import Any

import torch
from gen_backend_kit.lora import adapter_specs
from gen_interface.weights import WeightBase, combine_checksums, weights_checksum

from gen_vllm.checkpoint import checkpoint_specs
from gen_vllm.drafter import DRAFTER_PREFIX, draft_model_config, load_drafter_weights
from gen_vllm.messages import UpdateReport
from gen_vllm.staging import committed_weights_for

__all__ = ["UpdatableVllmInternalWorker"]


class UpdatableVllmInternalWorker:
    """Device-id reporting, checkpoint specs and update reports inside a vLLM worker.

    Attributes used from the vLLM worker it extends: ``device``, ``model_runner``,
    ``model_config``, ``rank``, ``weight_transfer_engine`` (this project's, with ``received``).
    """

    device: torch.device
    model_runner: Any
    model_config: Any
    rank: int
    weight_transfer_engine: Any
    _gen_shared_copy: Any = None  # the buckets share_committed_weights made, until released

    def report_device_id(self) -> str:
        """The GPU's UUID on CUDA (stable across processes); ``cpu:<host>:<pid>`` on CPU."""
        if self.device.type == "cuda":
            from gen_interface.weights.cuda_ipc import device_uuid

            return device_uuid(self.device)
        return f"cpu:{socket.gethostname()}:{os.getpid()}"

    def checkpoint_specs(self) -> tuple[dict[str, tuple[list[int], str]], list[str]]:
        """What an update must carry: ``({name: (shape, dtype)}, optional names)``, cached."""
        cached = getattr(self, "_gen_checkpoint_specs", None)
        if cached is None:
            specs, optional = checkpoint_specs(self.model_config.model, self.model_config.dtype)
            cached = self._gen_checkpoint_specs = (specs, sorted(optional))
        return cached

    def drafter_specs(self) -> tuple[dict[str, tuple[list[int], str]], list[str]]:
        """What an update may carry for the drafter model (``speculative.method``
        ``"draft_model"``): its checkpoint's names prefixed ``"drafter."``, shapes, and the
        engine's dtype; ``({}, [])`` without a drafter model. Cached."""
        cached = getattr(self, "_gen_drafter_specs", None)
        if cached is None:
            config = draft_model_config(getattr(self, "vllm_config", None))
            specs: dict[str, tuple[list[int], str]] = {}
            optional: set[str] = set()
            if config is not None:
                specs, optional = checkpoint_specs(config.model, config.dtype)
            cached = self._gen_drafter_specs = (
                {DRAFTER_PREFIX + name: spec for name, spec in specs.items()},
                sorted(DRAFTER_PREFIX + name for name in optional),
            )
        return cached

    def load_drafter_update(self) -> bool:
        """At the commit of an update that carried drafter tensors (kept aside by the transfer
        engine, each verified on arrival): load them into the drafter model, with the same
        layerwise reload as the target's. Returns whether the update carried any."""
        engine = self.weight_transfer_engine
        tensors = getattr(engine, "drafter", None)
        if not tensors:
            return False
        engine.drafter = {}
        config = draft_model_config(getattr(self, "vllm_config", None))
        if config is None:
            raise RuntimeError("drafter tensors arrived but this engine runs no drafter model")
        load_drafter_weights(self.model_runner.drafter.model, config, tensors)
        if getattr(engine, "committed", None) is not None:  # the copy holds the drafter's too
            engine.committed_drafter = {n: t.to("cpu") for n, t in tensors.items()}
        return True

    def drop_drafter_update(self) -> None:
        """The update was dropped: the drafter tensors kept aside for its commit are let go
        (the drafter never took them)."""
        engine = self.weight_transfer_engine
        if getattr(engine, "drafter", None):
            engine.drafter = {}

    # ---- the readable copy of the committed weights (staging.py) ---------------------------

    def keep_committed_weights(self) -> int:
        """From the next update on, keep a readable copy of the committed weights and stage
        every update in it (``vllm_cfg.weight_deltas``). Returns the bytes it will hold."""
        engine = self.weight_transfer_engine
        if getattr(engine, "committed", None) is None:
            specs, _ = self.checkpoint_specs()
            engine.committed = committed_weights_for(specs)
            engine.staged = False
        return sum(
            torch.Size(shape).numel() * getattr(torch, dtype).itemsize
            for shape, dtype in self.checkpoint_specs()[0].values()
        )

    def committed_weights_base(self) -> WeightBase | None:
        """The copy's ``WeightBase`` (None without a copy)."""
        committed = getattr(self.weight_transfer_engine, "committed", None)
        return None if committed is None else committed.base()

    def drop_staged_weights(self) -> None:
        """The update is dropped before its finish: undo it in the copy."""
        engine = self.weight_transfer_engine
        if getattr(engine, "committed", None) is not None:
            engine.drop_staged()

    def commit_staged_weights(self, version: int) -> None:
        """The update committed as ``version``: the copy is its weights."""
        committed = getattr(self.weight_transfer_engine, "committed", None)
        if committed is not None:
            committed.commit(version)

    def share_committed_weights(self) -> tuple[int | None, dict[str, Any]] | None:
        """Rank 0: the copy's version and its weights in shared-memory buckets (with their
        checksums), for a replacement replica to load through the same transport as a refit;
        other ranks, or without a copy: None. The buckets are this rank's until
        ``release_committed_weights`` (a replacement's read releases each one it read). Call
        only while no update is open: the copy stages updates in place."""
        committed = getattr(self.weight_transfer_engine, "committed", None)
        if committed is None or committed.version is None or int(self.rank) != 0:
            return None
        from gen_interface.weights.producer import share_weights

        self.release_committed_weights()
        # the drafter's committed tensors too, once an update carried them (until then the
        # drafter holds its checkpoint's, as a replacement's does)
        drafter = getattr(self.weight_transfer_engine, "committed_drafter", {})
        shared = self._gen_shared_copy = share_weights([*committed.items(), *drafter.items()])
        return committed.version, dict(shared.handles)

    def release_committed_weights(self) -> None:
        """Free the buckets ``share_committed_weights`` made, if any are left."""
        shared = getattr(self, "_gen_shared_copy", None)
        if shared is not None:
            shared.close()
            self._gen_shared_copy = None

    def capture_routed_experts(self, native: bool = False) -> list[int] | str:
        """Start reading every forward's MoE routing (``gen_vllm.routing``), or with
        ``native`` only describe it (vLLM's own option reads it): returns ``[MoE layers,
        top_k, experts per layer]``, or why it cannot (no MoE layer, ...)."""
        from gen_vllm.routing import RoutingCapture, moe_shape

        try:
            if native:
                return list(moe_shape(self.model_runner))
            capture = self._gen_routing = RoutingCapture(self.model_runner)
        except ValueError as exc:
            return str(exc)
        return [capture.layers, capture.top_k, capture.experts]

    def take_routed_experts(self, request_ids: list[str]) -> dict[str, bytes]:
        """The routing of finished requests, by request id (``RoutingCapture.take``)."""
        capture = getattr(self, "_gen_routing", None)
        return {} if capture is None else capture.take(request_ids)

    def write_adapter(self, directory: str, settings: dict[str, Any], initial: bool) -> bool:
        """Write the adapter the last update carried (``initial``: a zero adapter of the
        model's shape) as a PEFT directory; rank 0 writes. Returns whether one was written."""
        tensors = getattr(self.weight_transfer_engine, "adapter", None) or {}
        if initial:
            specs, _ = self.checkpoint_specs()
            shapes = {n: (torch.Size(s), getattr(torch, d)) for n, (s, d) in specs.items()}
            tensors = {
                name: torch.zeros(shape, dtype=dtype)
                for name, (shape, dtype) in adapter_specs(shapes, settings).items()
            }
        if not tensors:
            return False
        if int(self.rank) == 0:
            from gen_vllm.adapter import write_peft_adapter

            write_peft_adapter(directory, tensors, settings)
        return True

    def weight_update_report(self, compared: bool = True) -> UpdateReport:
        """After ``finish_weight_update``: this rank's account of the update.

        ``received_checksum`` combines the checksums of the buckets this rank read (each
        verified against its bytes on arrival), the same on every rank that read the same kind
        of copy; ``model_checksum`` covers this rank's parameters as loaded (its own shard under
        tensor parallelism), so rank r of every replica must agree.

        Args:
            compared: other replicas' reports will be compared with this one. Without (a
                single replica) the model and packed-layer checksums, a pass over every weight
                that nothing would compare, are not computed (None).
        """
        received = getattr(self.weight_transfer_engine, "received", [])
        model = self.model_runner.get_model()
        return UpdateReport(
            rank=int(self.rank),
            device_id=self.report_device_id(),
            received_checksum=combine_checksums(received),
            model_checksum=self.model_checksum() if compared else None,
            packed_checksum=packed_layers_checksum(model) if compared else None,
            kernel=kernel_description() if self.device.type == "cpu" else "",
            drafter_checksum=self.drafter_checksum() if compared else None,
        )

    def drafter_checksum(self) -> int | None:
        """The drafter's weights as they will be served after this update's commit: while an
        update holds drafter tensors for the commit (after its finish), the checksum of those
        tensors (every replica of the update holds the same, verified); else of the drafter
        model's non-empty parameters and buffers and of what its packed layers compute
        (``packed_layers_checksum``). None without a drafter model."""
        drafter = getattr(getattr(self.model_runner, "drafter", None), "model", None)
        if draft_model_config(getattr(self, "vllm_config", None)) is None or drafter is None:
            return None
        pending = getattr(self.weight_transfer_engine, "drafter", None)
        if pending:  # tagged: never equal to a loaded drafter's by construction
            return combine_checksums([_PENDING_DRAFTER, weights_checksum(pending.items())])
        named = [
            (name, tensor)
            for name, tensor in [*drafter.named_parameters(), *drafter.named_buffers()]
            if tensor.numel()
        ]
        packed = packed_layers_checksum(drafter)
        return combine_checksums([weights_checksum(named), 0 if packed is None else packed])

    def model_checksum(self) -> int:
        """Checksum of the model's non-empty parameters and buffers as loaded (after packing;
        CPU linear layers keep their packed weights outside any parameter, which
        ``packed_layers_checksum`` covers)."""
        model = self.model_runner.get_model()
        named = [
            (name, tensor)
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]
            if tensor.numel()
        ]
        return weights_checksum(named)


#: Marks ``drafter_checksum``'s form for tensors waiting for the commit.
_PENDING_DRAFTER = 1

#: Rows of the fixed input every packed layer computes on for ``packed_layers_checksum``.
_FINGERPRINT_ROWS = 4


def packed_layers_checksum(model: torch.nn.Module) -> int | None:
    """Checksum of what every packed layer computes on a fixed input; None when none is packed.

    A packed layer is one whose ``weight`` was emptied after its values moved into a kernel's
    own buffer (vLLM's CPU linear layers: ``cpu_linear`` over oneDNN or SGL packed weights), so
    no parameter checksum can see them. Its output on a fixed input is exact and repeatable for
    one kernel, machine and thread count, so equal weights give equal checksums there.
    """
    results = []
    for name, layer in model.named_modules():
        weight = getattr(layer, "weight", None)
        compute = getattr(layer, "cpu_linear", None)
        width = getattr(layer, "input_size_per_partition", None)
        if compute is None or not isinstance(weight, torch.Tensor) or weight.numel() or not width:
            continue
        dtype = getattr(layer, "params_dtype", weight.dtype)
        generator = torch.Generator().manual_seed(0)
        probe = torch.randn(_FINGERPRINT_ROWS, int(width), generator=generator).to(dtype)
        with torch.inference_mode():
            results.append((name, compute(probe, weight, None)))
    return weights_checksum(results) if results else None


def kernel_description() -> str:
    """What a CPU kernel's exact results depend on: the CPU model and the thread count."""
    model = platform.processor() or platform.machine()
    cpuinfo = "/proc/cpuinfo"
    if os.path.exists(cpuinfo):
        with open(cpuinfo) as info:
            model = next(
                (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
                model,
            )
    return f"{model}, {torch.get_num_threads()} threads"
