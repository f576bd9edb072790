"""The vLLM weight-transfer engine of this project, registered as ``"gen"``.

vLLM 0.32 runs weight updates as a transaction in each worker: ``start_weight_update`` (layers
go to the meta device, their old storage kept), any number of ``update_weights`` chunks (each
layer is processed, packed and copied back into its old storage as soon as all its tensors
arrived), ``finish_weight_update``. Its own transport engines (NCCL, CUDA IPC) need CUDA and
vLLM in the trainer; this one receives this project's loads (``receive.py``: shared-memory or
CUDA IPC buckets, or a broadcast over a weight group made of plain torch process groups), so the
trainer needs gen-interface only, and the same engine runs on CPU and GPU.

vLLM imports this module in every worker (it holds the ``worker_extension_cls``), which
registers the engine before the worker builds it.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from gen_backend_kit.lora import is_adapter_weight
from gen_backend_kit.weights import CommittedWeights
from gen_interface import WeightUpdateError
from gen_interface.weights.collective import CollectiveEndpoint, WeightGroup, join_weight_group
from gen_interface.weights.delta import TensorDelta
from gen_interface.weights.handles import TensorSlot
from gen_interface.weights.layout import Entry
from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from gen_vllm.cpu_kernels import fix_speculative_sampling
from gen_vllm.drafter import is_drafter_weight
from gen_vllm.extension import UpdatableVllmInternalWorker
from gen_vllm.receive import receive_load, whole_tensors
from gen_vllm.seeded_drafts import seed_draft_sampling
from gen_vllm.staging import EngineLoads

__all__ = ["ENGINE_NAME", "GenWeightTransferEngine", "UpdatableVllmInternalWorker"]

ENGINE_NAME = "gen"


@dataclass
class GenInitInfo(WeightTransferInitInfo):
    """Joining the trainer's weight group (the collective path)."""

    endpoint: dict[str, Any] = field(default_factory=dict)  # a CollectiveEndpoint
    rank: int = 0  # this engine's first rank in the group; tensor-parallel rank r adds r


@dataclass
class GenUpdateInfo(WeightTransferUpdateInfo):
    """One load: a ``receive.LoadInfo`` (shared handles or a broadcast bucket)."""

    handles: dict[str, Any] | None = None
    broadcast: dict[str, Any] | None = None


class GenWeightTransferEngine(WeightTransferEngine[GenInitInfo, GenUpdateInfo]):
    """Loads this project's weight loads into the model with vLLM's layerwise reload.

    ``received`` holds the checksum of every bucket of the current transaction, in order;
    ``adapter`` the LoRA adapter tensors it carried (copies, kept for the worker to serve at the
    commit: vLLM's model takes none of them); ``drafter`` the drafter model's tensors it carried
    (``"drafter."`` names, copies, loaded into the drafter at the commit: ``drafter.py``). vLLM's
    layerwise reload starts with the first bucket that carries base weights, so an update of
    the adapter or the drafter alone leaves the model untouched.

    ``committed``: with ``vllm_cfg.weight_deltas``, the readable copy of the last committed
    weights (``staging.py``); every update is then staged there, and ``loads`` says when its
    tensors reach the engine (as their bucket arrives while they come as deltas, else at the
    finish) and restores them when the update is dropped.
    """

    init_info_cls = GenInitInfo
    update_info_cls = GenUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # the worker builds this engine after its platform registered the kernel stand-ins:
        # correct vLLM-CPU's rejection sampler, which speculative sampling needs (cpu_kernels),
        # and draw seeded rows' probabilistic drafts from their own generators (seeded_drafts)
        fix_speculative_sampling()
        seed_draft_sampling()
        self.received: list[int] = []
        self.adapter: dict[str, torch.Tensor] = {}
        self.drafter: dict[str, torch.Tensor] = {}
        self.group: WeightGroup | None = None
        self.committed: CommittedWeights | None = None
        # with ``committed``: the drafter's tensors as last committed (none until an update
        # carries them: the drafter then holds its checkpoint's), for replacements
        self.committed_drafter: dict[str, torch.Tensor] = {}
        self.staged = False  # this update wrote into ``committed``
        self.loads = EngineLoads()
        self._reloading = False

    def init_transfer_engine(self, init_info: GenInitInfo) -> None:
        rank = init_info.rank + int(self.vllm_config.parallel_config.rank)
        endpoint = CollectiveEndpoint(**init_info.endpoint)  # type: ignore[typeddict-item]
        self.group = join_weight_group(endpoint, rank, torch.device(self.device))

    def start_weight_update(self) -> None:
        self.received, self.adapter, self.drafter, self._reloading = [], {}, {}, False
        self.staged = False
        self.loads.begin()
        if self.committed is not None:
            self.committed.begin()

    def receive_weights(self, update_info: GenUpdateInfo) -> None:
        info = {k: v for k, v in vars(update_info).items() if v is not None}
        gpu = _device_uuid(self.device)
        for bucket in receive_load(info, device_uuid=gpu, group=self.group):
            if self.committed is not None:
                self.staged = True
                now = self.loads.stage(self.committed, self._drafter_aside(bucket.entries))
                if now:
                    self._load(now)
                self.received.append(bucket.checksum)
                continue
            base = self._keep_aside(whole_tensors(bucket.entries))
            if self._reloading or not all(map(_kept_aside, bucket.names)):
                self._load(base)
            else:  # an adapter or drafter bucket: read (and verify) every tensor
                collections.deque(base, maxlen=0)
            if bucket.shared is not None:
                _own_pending_tensors(self.model, bucket.shared)
            self.received.append(bucket.checksum)

    def _drafter_aside(
        self, entries: Iterator[tuple[TensorSlot, Entry]]
    ) -> Iterator[tuple[TensorSlot, Entry]]:
        """With the copy of the committed weights: the target's entries, to stage in it; the
        drafter's are whole tensors (never deltas: the copy is the target's base), kept in
        ``drafter`` for the commit like any update's, and in ``committed_drafter`` from then
        on (``load_drafter_update``).

        Raises:
            WeightUpdateError (while iterating): a drafter tensor arrived as a delta.
        """
        for slot, entry in entries:
            name = slot["name"]
            if not is_drafter_weight(name):
                yield slot, entry
            elif isinstance(entry, TensorDelta):
                raise WeightUpdateError(
                    f"weight {name!r} arrived as a delta: the drafter's tensors are taken whole "
                    "(the copy of the committed weights is a base for the target's only)"
                )
            else:
                self.drafter[name] = entry.to(self.device, copy=True)

    def _keep_aside(
        self, tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The base weights of ``tensors``; adapter tensors are copied into ``adapter``, the
        drafter's into ``drafter`` (on the model's device: the bucket is reused)."""
        for name, tensor in tensors:
            if is_adapter_weight(name):
                self.adapter[name] = tensor.to("cpu", copy=True)
            elif is_drafter_weight(name):
                self.drafter[name] = tensor.to(self.device, copy=True)
            else:
                yield name, tensor

    def finish_weight_update(self) -> None:
        if self.staged and self.committed is not None:  # what is staged and not loaded yet
            self.staged = False
            rest = self.loads.remaining(self.committed)
            self._load_then_end(rest, "loading the staged weights into the engine")
        self._end_reload()

    def drop_staged(self) -> None:
        """The update is dropped: the copy undoes it (or, when a tensor came whole, holds no
        base until a complete update); if any of it had reached the engine, the engine loads
        the whole copy again (``EngineLoads.drop``)."""
        if self.committed is not None:
            restore = self.loads.drop(self.committed)
            # layers loaded in part hold garbage until reloaded: end that reload first
            self._load_then_end([], "ending the dropped update's reload")
            self._load_then_end(restore or [], "restoring the committed weights in the engine")
            if restore is None:
                raise RuntimeError(
                    "a dropped weight update had reached the engine and the copy of the "
                    "committed weights cannot give them all back: the engine's weights are "
                    "unknown"
                )
        self.staged = False

    def _load_then_end(self, tensors: Any, what: str) -> None:
        """Load ``tensors`` (if any) and end the reload.

        Raises:
            RuntimeError: that failed; the engine's weights are then unknown (not a refusal).
        """
        try:
            if tensors:
                self._load(tensors)
            self._end_reload()
        except Exception as exc:
            raise RuntimeError(f"{what} failed: {exc}") from exc

    def _load(self, tensors: Any) -> None:
        """Load ``tensors`` into the model, inside one layerwise reload (begun here if none
        is open; ``_end_reload`` ends it)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if not self._reloading:
            initialize_layerwise_reload(self.model)
            self._reloading = True
        cast(Any, self.model).load_weights(tensors)

    def _end_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._reloading:
            finalize_layerwise_reload(self.model, self.model_config)
            self._reloading = False

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """Make ``weight_transfer_config={"backend": "gen"}`` available in this process."""
    with contextlib.suppress(ValueError):  # already registered
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, GenWeightTransferEngine)


def _kept_aside(name: str) -> bool:
    """Tensors the target model never takes: a LoRA adapter's and the drafter model's."""
    return is_adapter_weight(name) or is_drafter_weight(name)


def _device_uuid(device: torch.device | str) -> str | None:
    device = torch.device(device)
    if device.type != "cuda":
        return None
    from gen_interface.weights.cuda_ipc import device_uuid

    return device_uuid(device)


def _own_pending_tensors(model: torch.nn.Module, bucket: torch.Tensor) -> None:
    """Copy out of ``bucket`` the tensors vLLM still holds for layers not complete yet.

    Layerwise reload keeps the tensors of a layer until all of them arrived (a fused qkv or
    gate_up layer may straddle two buckets), but the producer reuses ``bucket`` for a later
    load. Tensors of complete layers were copied into the model already; these are the rest.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    start = bucket.untyped_storage().data_ptr()
    end = start + bucket.untyped_storage().nbytes()
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.loaded_weights:
            continue
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and start <= value.data_ptr() < end:
                    bound.arguments[key] = value.clone()


register()
