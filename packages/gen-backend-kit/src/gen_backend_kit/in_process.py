"""``InProcessBackend``: a backend whose model lives in this process and decodes step by step.

Its decode loop runs every forward pass inside ``self.gate.step(...)`` (``StepGate``); the weight
steps here use the same gate, so an update lands between two steps: running calls pause and go
on with the new weights (``"keep"``), end cut short (``"abort"``), or, when an update is
dropped after a write, end cut short too. Weight writes hold the gate's lock, so no step reads
a tensor half written. A subclass writes tensors (``_write_tensors``) and decodes; the rest of
the weight-update path is here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from gen_interface.interface import InFlight

from gen_backend_kit.backend import GenerationBackend
from gen_backend_kit.stepping import StepGate
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
                write_shared_weights(handles, targets)
            else:
                self._write_tensors(iter_shared_weights(handles))

    def _write_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        with self.gate.lock:
            self._write_tensors(state_dict.items())

    def _begin_update(self, version: int, in_flight: InFlight) -> None:
        self.gate.close(in_flight)

    def _commit_update(self, version: int) -> None:
        self.gate.reopen(version)

    def _abort_update(self, written: bool) -> None:
        self.gate.reopen(None, cut=written)
