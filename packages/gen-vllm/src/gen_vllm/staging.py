"""Updates staged in a worker's readable copy of its committed weights (``weight_deltas``).

vLLM's CPU linear layers pack their weights into oneDNN buffers that no parameter can give back,
so a worker that takes deltas keeps the kit's ``CommittedWeights`` of its own: one copy of the
model in its dtype, in the worker's host memory (per tensor-parallel rank, each a full copy).
Every update is staged there: a whole tensor is copied in (cast to the model's dtype), a delta
is checked against the copy's version and tensor, applied in place and its result checked
against the trainer's checksum. Nothing reaches the engine before the commit, which loads every
weight from the copy through vLLM's layerwise reload (``load_staged``). So an update refused or
dropped before its commit leaves what the engine serves untouched, and is undone in the copy
(``CommittedWeights.rollback``).

This module imports no vLLM, so test fakes run it as the engine does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from gen_backend_kit.weights import CommittedWeights
from gen_interface.weights.delta import TensorDelta
from gen_interface.weights.handles import TensorSlot
from gen_interface.weights.layout import Entry

__all__ = ["committed_weights_for", "stage_entries"]


def committed_weights_for(specs: dict[str, tuple[list[int], str]]) -> CommittedWeights:
    """An empty owned copy for a model of ``specs`` (``checkpoint_specs``' form)."""
    return CommittedWeights.owning(
        {name: (torch.Size(shape), getattr(torch, dtype)) for name, (shape, dtype) in specs.items()}
    )


def stage_entries(committed: CommittedWeights, entries: Iterable[tuple[TensorSlot, Entry]]) -> None:
    """Stage one bucket's entries in ``committed`` (see the module docstring).

    Raises:
        WeightBaseError: a delta names another base; nothing of it was written.
        WeightUpdateError: bytes damaged, a delta malformed or making another tensor than the
            trainer's (undone); the entries before it are staged, and undone by a rollback.
    """
    for slot, entry in entries:
        name = slot["name"]
        if isinstance(entry, TensorDelta):
            committed.apply(name, entry)
            continue
        wanted = committed.specs.get(name, (entry.shape, entry.dtype))[1]
        # a host checksum of these very bytes, when they arrive in the model's dtype
        known = slot["checksum"] if "chunks" in slot and entry.dtype == wanted else None
        committed.write(name, entry, known)
