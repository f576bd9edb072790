"""Updates staged in a worker's readable copy of its committed weights (``weight_deltas``).

vLLM's CPU linear layers pack their weights into oneDNN buffers that no parameter can give back,
so a worker that takes deltas keeps the kit's ``CommittedWeights`` of its own: one copy of the
model in its dtype, in the worker's host memory (per tensor-parallel rank, each a full copy).
Every update is staged there: a whole tensor is copied in (cast to the model's dtype), a delta
is checked against the copy's version and tensor, applied in place and its result checked
against the trainer's checksum.

When the staged tensors reach the engine (``EngineLoads``): a tensor that came as a delta can be
undone in the copy (the same XOR again), so it is loaded into the (paused) engine as soon as its
bucket is staged, while the rest of the update is still on its way, as a whole refit loads each
bucket as it arrives. Once a tensor of the update comes whole (which the copy cannot undo), the
rest of the update waits for the commit. An update dropped after loads undoes itself in the
copy (``CommittedWeights.rollback``) and the engine loads the whole copy again, so it serves its
committed weights as before. Where the copy cannot give them all back (a tensor of the dropped
update came whole after loads began, or the copy holds only part of the model), the engine's
weights are unknown and the worker says so (a healing fleet replaces the replica).

This module imports no vLLM, so test fakes run it as the engine does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from gen_backend_kit.weights import CommittedWeights
from gen_interface.weights.delta import TensorDelta
from gen_interface.weights.handles import TensorSlot
from gen_interface.weights.layout import Entry

__all__ = ["EngineLoads", "committed_weights_for", "stage_entries"]


#: Tensors by checkpoint name, in the order to load them into the engine.
Tensors = list[tuple[str, torch.Tensor]]


def committed_weights_for(specs: dict[str, tuple[list[int], str]]) -> CommittedWeights:
    """An empty owned copy for a model of ``specs`` (``checkpoint_specs``' form)."""
    return CommittedWeights.owning(
        {name: (torch.Size(shape), getattr(torch, dtype)) for name, (shape, dtype) in specs.items()}
    )


def stage_entries(
    committed: CommittedWeights, entries: Iterable[tuple[TensorSlot, Entry]]
) -> list[tuple[str, torch.Tensor, bool]]:
    """Stage one bucket's entries in ``committed`` (see the module docstring): per entry, its
    name, the copy's tensor it wrote, and whether it came as a delta.

    Raises:
        WeightBaseError: a delta names another base; nothing of it was written.
        WeightUpdateError: bytes damaged, a delta malformed or making another tensor than the
            trainer's (undone); the entries before it are staged, and undone by a rollback.
    """
    staged = []
    for slot, entry in entries:
        name = slot["name"]
        if isinstance(entry, TensorDelta):
            staged.append((name, committed.apply(name, entry), True))
            continue
        wanted = committed.specs.get(name, (entry.shape, entry.dtype))[1]
        # a host checksum of these very bytes, when they arrive in the model's dtype
        known = slot["checksum"] if "chunks" in slot and entry.dtype == wanted else None
        staged.append((name, committed.write(name, entry, known), False))
    return staged


class EngineLoads:
    """Which staged tensors a worker loads into its engine, and when (module docstring).

    Per update: ``begin``, ``stage`` per bucket (load what it returns), then ``remaining`` at
    the finish (load it), or ``drop`` when the update is dropped (load what it returns).
    """

    def __init__(self) -> None:
        self._loaded: dict[str, torch.Tensor] = {}  # in the engine, by name, in load order
        self._early = True  # every tensor so far came as a delta

    def begin(self) -> None:
        self._loaded, self._early = {}, True

    def stage(
        self, committed: CommittedWeights, entries: Iterable[tuple[TensorSlot, Entry]]
    ) -> Tensors:
        """Stage one bucket (``stage_entries``); the tensors to load into the engine now: the
        bucket's, while every tensor of the update came as a delta, else none."""
        staged = stage_entries(committed, entries)
        if not all(delta for _, _, delta in staged):
            self._early = False
        if not self._early:
            return []
        return self._mark([(name, tensor) for name, tensor, _ in staged])

    def remaining(self, committed: CommittedWeights) -> Tensors:
        """At the finish: the staged tensors not loaded yet."""
        return self._mark([(n, t) for n, t in committed.staged_items() if n not in self._loaded])

    def drop(self, committed: CommittedWeights) -> Tensors | None:
        """The update is dropped: undo it in the copy. Returns what the engine must load
        again, in a layerwise reload of its own, to serve the committed weights: nothing when
        nothing reached it; else every tensor of the copy (a layer whose weights were partly
        loaded when the update stopped holds garbage in the rest, so the whole model is
        loaded); None when the copy cannot give them all back (a tensor of the update came
        whole, or the copy lacks some of the model's tensors): the engine's weights are then
        unknown."""
        intact = committed.rollback()
        loaded = bool(self._loaded)
        self.begin()
        if not loaded:
            return []
        tensors = list(committed.items())
        if not intact or {name for name, _ in tensors} != set(committed.specs):
            return None
        return tensors

    def _mark(self, tensors: Tensors) -> Tensors:
        self._loaded.update(tensors)
        return tensors
