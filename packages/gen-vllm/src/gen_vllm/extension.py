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
import socket
from typing import Any

import torch
from gen_interface.weights import combine_checksums, weights_checksum

from gen_vllm.checkpoint import checkpoint_specs
from gen_vllm.messages import UpdateReport

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

    def weight_update_report(self) -> UpdateReport:
        """After ``finish_weight_update``: this rank's account of the update.

        ``received_checksum`` combines the checksums of the buckets this rank read (each
        verified against its bytes on arrival), the same on every rank that read the same kind
        of copy; ``model_checksum`` covers this rank's parameters as loaded (its own shard under
        tensor parallelism), so rank r of every replica must agree.
        """
        received = getattr(self.weight_transfer_engine, "received", [])
        return UpdateReport(
            rank=int(self.rank),
            device_id=self.report_device_id(),
            received_checksum=combine_checksums(received),
            model_checksum=self.model_checksum(),
        )

    def model_checksum(self) -> int:
        """Checksum of the model's non-empty parameters and buffers as loaded (after packing;
        CPU linear layers keep their packed weights outside any parameter, which the driver's
        probe covers)."""
        model = self.model_runner.get_model()
        named = [
            (name, tensor)
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]
            if tensor.numel()
        ]
        return weights_checksum(named)
