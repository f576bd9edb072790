"""Zero-copy refits: a trainer's host weights kept in shared memory this project owns, so that a
refit sends handles that point at the trainer's own tensors instead of copying them into buckets.

    with share_parameters(model) as shared:       # parameters and buffers now live in /dev/shm
        for step in range(steps):
            train_step(model)
            refitter.refit(model.state_dict())     # no trainer-side copy: only checksums

``share_parameters`` moves every parameter and buffer of a CPU module into shared-memory segments
(``param.data`` then views a segment), once; the optimizer and the training step use them as
before. ``Refitter.refit`` finds which tensors live in such segments and sends those in place.
While a refit runs, the trainer must not write to those tensors (no optimizer step, no
``load_state_dict``): a write that lands before a worker has read a chunk is refused by its
checksum (the update aborts); one that lands after would not be seen. Refit, then step.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping

import torch

from gen_interface.weights.chunked import chunk_checksums
from gen_interface.weights.handles import WeightHandles
from gen_interface.weights.layout import (
    Allocation,
    NamedTensors,
    Place,
    describe_bucket,
    group_bytes,
    local_handles,
    pack,
    plan_buckets,
    slot_view,
    tensor_slot,
)
from gen_interface.weights.shm import unlink_segment

__all__ = [
    "SharedParameters",
    "in_place_handles",
    "share_parameters",
    "share_tensors",
    "split_in_place",
]

#: Bytes per segment of ``share_parameters``: one load each, so large (vLLM's per-load cost is
#: fixed) but a few per model, so a worker reads one while the trainer hashes the next.
DEFAULT_SEGMENT_BYTES = 256 * 2**20

# Live segments of every SharedParameters in this process, by path.
_SEGMENTS: dict[str, Allocation] = {}
_SEGMENTS_LOCK = threading.Lock()


class SharedParameters:
    """The shared-memory segments a module's parameters and buffers live in.

    Close it (or leave the ``with`` block) once no refit needs them in place any more: the
    segments' names go, and so does their memory when the module lets go of its tensors (they
    stay valid until then; later refits copy them like any other tensor).
    """

    def __init__(self, allocations: list[Allocation]):
        self.paths = [a.path for a in allocations]
        with _SEGMENTS_LOCK:
            _SEGMENTS.update((a.path, a) for a in allocations)
        self._finalizer = weakref.finalize(self, _forget, list(self.paths))

    def close(self) -> None:
        """Unlink the segments. Idempotent."""
        self._finalizer()

    def __enter__(self) -> SharedParameters:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def share_parameters(
    module: torch.nn.Module, *, segment_bytes: int = DEFAULT_SEGMENT_BYTES
) -> SharedParameters:
    """Move every parameter and buffer of ``module`` into shared memory, in place.

    Values, dtypes, shapes, ``requires_grad`` and parameter identity are kept (optimizers built
    before keep working); tied parameters stay tied. Only the tensors' storage moves.

    Args:
        module: a model on the CPU.
        segment_bytes: bytes per segment; a tensor larger than that gets a segment of its own.

    Raises:
        ValueError: a parameter or buffer is not on the CPU.
    """
    tensors: NamedTensors = []
    seen: set[int] = set()
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors.append((name, tensor))
    shared, views = _copy_into_segments(tensors, segment_bytes)
    with torch.no_grad():
        for (_, tensor), view in zip(tensors, views, strict=True):
            tensor.data = view
    return shared


def share_tensors(
    state_dict: Mapping[str, torch.Tensor], *, segment_bytes: int = DEFAULT_SEGMENT_BYTES
) -> tuple[dict[str, torch.Tensor], SharedParameters]:
    """Copies of host tensors that live in shared memory: for a trainer that keeps its own copy
    of the weights to refit from (e.g. float32 master weights offloaded to the host) and
    updates it in place (``copy_``) after each step.

    Returns:
        ``({name: copy}, the segments)``; refits of the copies send them in place.

    Raises:
        ValueError: a tensor is not on the CPU.
    """
    tensors = list(state_dict.items())
    shared, views = _copy_into_segments(tensors, segment_bytes)
    return {name: view for (name, _), view in zip(tensors, views, strict=True)}, shared


def _copy_into_segments(
    tensors: NamedTensors, segment_bytes: int
) -> tuple[SharedParameters, list[torch.Tensor]]:
    """New segments holding copies of ``tensors``, and a view of each copy, in order."""
    for name, tensor in tensors:
        if tensor.device.type != "cpu":
            raise ValueError(
                f"only host weights can live in shared memory; {name!r} is on {tensor.device} "
                "(GPU weights are shared through CUDA IPC buckets)"
            )
    allocations: list[Allocation] = []
    views: list[torch.Tensor] = []
    try:
        for group in plan_buckets(tensors, segment_bytes):
            allocation = Place(None).allocate(group_bytes(group))
            allocations.append(allocation)
            slots, _ = pack(allocation.data, group)
            views.extend(slot_view(allocation.data, slot) for slot in slots)
    except BaseException:
        for allocation in allocations:
            unlink_segment(allocation.path)
        raise
    return SharedParameters(allocations), views


def split_in_place(
    tensors: NamedTensors,
) -> tuple[list[tuple[Allocation, NamedTensors]], NamedTensors]:
    """Tensors that can be sent in place, grouped by the segment they live in (in order of
    first appearance), and the rest (to be copied)."""
    with _SEGMENTS_LOCK:
        segments = list(_SEGMENTS.values())
    if not segments:
        return [], tensors
    groups: dict[str, tuple[Allocation, NamedTensors]] = {}
    rest: NamedTensors = []
    for name, tensor in tensors:
        segment = _segment_of(tensor, segments)
        if segment is None:
            rest.append((name, tensor))
        else:
            groups.setdefault(segment.path, (segment, []))[1].append((name, tensor))
    return list(groups.values()), rest


def in_place_handles(segment: Allocation, group: NamedTensors) -> WeightHandles:
    """Handles to ``group``'s tensors where they are, in ``segment``, each with its chunk
    checksums (one read of their bytes, no copy)."""
    base = segment.data.data_ptr()
    slots = [
        tensor_slot(
            name,
            tensor,
            tensor.data_ptr() - base,
            chunk_checksums(tensor.detach().reshape(-1).view(torch.uint8)),
        )
        for name, tensor in group
    ]
    bucket = describe_bucket(segment, segment.capacity, slots)
    return local_handles([bucket], release_after_read=False)


def _segment_of(tensor: torch.Tensor, segments: list[Allocation]) -> Allocation | None:
    """The segment holding all of ``tensor``'s bytes, if it is contiguous and on the CPU."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    for segment in segments:
        low = segment.data.data_ptr()
        if low <= start and end <= low + segment.capacity:
            return segment
    return None


def _forget(paths: list[str]) -> None:
    with _SEGMENTS_LOCK:
        for path in paths:
            _SEGMENTS.pop(path, None)
    for path in paths:
        unlink_segment(path)
