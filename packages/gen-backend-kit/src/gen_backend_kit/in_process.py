"""``InProcessBackend``: a backend whose model lives in this process and decodes step by step.

Its decode loop runs every forward pass inside ``self.gate.step(...)`` (``StepGate``); the weight
steps here use the same gate, so an update lands between two steps: running calls pause and go
on with the new weights (``"keep"``), end cut short (``"abort"``), or, when an update is
dropped after a write, end cut short too. Weight writes hold the gate's lock, so no step reads
a tensor half written. A subclass writes tensors (``_write_tensors``) and decodes; the rest of
the weight-update path is here.

Deltas: where the model's tensors are host tensors by name (``_weight_targets``), they are the
backend's ``CommittedWeights`` (views, no copy): a delta applies to the model's own tensor in
place, under the gate's lock, and is undone there if the tensor it makes is not the trainer's.
An update dropped after only deltas were written is undone the same way, so the rows it paused
go on with the old weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from gen_interface.interface import InFlight
from gen_interface.weights.handles import WeightBase

from gen_backend_kit.backend import GenerationBackend
from gen_backend_kit.stepping import StepGate
from gen_backend_kit.weights.committed import CommittedWeights
from gen_backend_kit.weights.consumer import iter_shared_weights, write_shared_weights

__all__ = ["InProcessBackend"]


class InProcessBackend(GenerationBackend):
    """``GenerationBackend`` plus the gate its decode steps and weight updates share.

    Attributes:
        gate: every forward pass runs in ``gate.step(mark)``, every weight write under
            ``gate.lock``.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        self.gate = StepGate()
        self._committed: CommittedWeights | None = None
        self._committed_of: Mapping[str, torch.Tensor] | None = None
        super().__init__(*args, **kwargs)

    def _write_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each ``(checkpoint name, tensor)`` into the model, in place, casting floats
        (the caller holds ``gate.lock`` and checked names, shapes and dtypes)."""
        raise NotImplementedError(f"{type(self).__name__} does not support weight updates")

    def _weight_targets(self) -> Mapping[str, torch.Tensor] | None:
        """The model's tensors by checkpoint name, to copy shared weights straight into (the
        caller holds ``gate.lock``); None to receive them through ``_write_tensors``."""
        return None

    def _load_handles(self, handles: Mapping[str, Any]) -> None:
        # Each byte is verified just before it is copied in, while it is in cache.
        with self.gate.lock:
            targets = self._weight_targets()
            if targets is not None:
                write_shared_weights(handles, targets, self._committed_weights())
            else:
                self._write_tensors(iter_shared_weights(handles))

    def _write_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        with self.gate.lock:
            self._write_tensors(state_dict.items())
            committed = self._committed_weights()
            targets = self._weight_targets()
            if committed is not None and targets is not None:
                for name in state_dict:
                    committed.write(name, targets[name])

    def _begin_update(self, version: int, in_flight: InFlight) -> None:
        self.gate.close(in_flight)
        with self.gate.lock:
            committed = self._committed_weights()
            if committed is not None:
                committed.begin()

    def _commit_update(self, version: int) -> None:
        with self.gate.lock:
            committed = self._committed_weights()
            if committed is not None:
                committed.commit(version)
        self.gate.reopen(version)

    def _abort_update(self, written: bool) -> None:
        if not written:
            with self.gate.lock:
                if self._committed is not None:
                    self._committed.rollback()
        self.gate.reopen(None, cut=written)

    def _restore_weights(self) -> bool:
        with self.gate.lock:
            return self._committed is not None and self._committed.rollback()

    def _weight_base(self) -> WeightBase | None:
        with self.gate.lock:
            committed = self._committed_weights()
            return None if committed is None else committed.base()

    def _committed_weights(self) -> CommittedWeights | None:
        """Views of the model's tensors (``_weight_targets``), when they are host tensors and no
        part of the model is staged apart (an adapter refits whole); the caller holds the lock."""
        targets = self._weight_targets()
        weights = self.weight_updates
        if targets is None or weights is None or weights.staged:
            return None
        if targets is not self._committed_of:  # first use, or the model's tensors moved
            self._committed_of = targets
            try:
                absent = self.lifecycle.weights_absent is not None
                version = None if absent else weights.version
                self._committed = CommittedWeights.viewing(targets, version)
            except ValueError:  # not host tensors: no deltas
                self._committed = None
        return self._committed
