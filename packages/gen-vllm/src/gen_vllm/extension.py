"""``UpdatableVllmInternalWorker``: the vLLM worker extension (``worker_extension_cls``).

vLLM mixes this class into each of its workers; its methods run there, reached through
``LLM.collective_rpc``. Arguments cross that boundary as plain data (handles are dicts of str,
int, bytes and lists), so they pass msgspec as well as pickle.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
from gen_interface.weights import (
    describe_weight_handles,
    handles_for_device,
    read_shared_weights,
    weights_checksum,
)

from gen_vllm.checkpoint import check_update_is_complete, checkpoint_specs
from gen_vllm.messages import UpdateReport

__all__ = ["UpdatableVllmInternalWorker"]


class UpdatableVllmInternalWorker:
    """Device-id reporting and in-place weight updates inside a vLLM worker.

    Attributes used from the vLLM worker it extends: ``device``, ``model_runner``,
    ``model_config``.
    """

    device: torch.device
    model_runner: Any
    model_config: Any
    rank: int

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

    def update_weights_from_ipc_handles(self, handles: dict[str, Any]) -> UpdateReport:
        """Check, read and load the weights ``handles`` describe, through vLLM's in-place reload.

        Names, shapes and dtypes are checked against the checkpoint before anything is written.
        The reload re-runs vLLM's weight processing (fusing, CPU packing).

        Returns:
            This rank's ``UpdateReport``: the checksum of the tensors read (the same on every
            rank) and of its own parameters after loading (its shard under tensor parallelism),
            so the caller can check that every worker took the same update.

        Raises:
            WeightUpdateError: the update does not match the checkpoint, or a bucket is gone or
                changed; nothing was written.
        """
        start = time.perf_counter()
        gpu = self.report_device_id() if self.device.type == "cuda" else None
        handles = handles_for_device(handles, gpu)  # this GPU's copy, else host memory
        specs, optional = self.checkpoint_specs()
        check_update_is_complete(describe_weight_handles(handles), specs, set(optional))
        tensors = read_shared_weights(handles)
        received = weights_checksum(tensors)
        self.model_runner.reload_weights(weights_iterator=iter(tensors))
        return UpdateReport(
            rank=int(self.rank),
            device_id=self.report_device_id(),
            received_checksum=received,
            model_checksum=self.model_checksum(),
            seconds=time.perf_counter() - start,
        )

    def model_checksum(self) -> int:
        """Checksum of the model's non-empty parameters and buffers as loaded (after packing)."""
        model = self.model_runner.get_model()
        named = [
            (name, tensor)
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]
            if tensor.numel()
        ]
        return weights_checksum(named)
