"""Producer side, one shot: a state dict becomes a few shared buckets and plain handles.

For updates larger than memory can hold twice, stream them instead (``gen_interface.weights
.refit``): the same buckets, a fixed few of them, reused.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence

import torch

from gen_interface.weights.delta import TensorDelta
from gen_interface.weights.handles import WeightBucket, WeightHandles
from gen_interface.weights.layout import (
    Allocation,
    Entry,
    NamedEntries,
    fill_bucket,
    group_bytes,
    local_handles,
    plan_buckets,
    resolve_places,
)
from gen_interface.weights.shm import unlink_segment

__all__ = ["DEFAULT_BUCKET_BYTES", "SharedWeights", "named_tensors", "share_weights"]

#: Bucket size: large enough that a model is a handful of buckets, small enough to stage.
DEFAULT_BUCKET_BYTES = 512 * 2**20


class SharedWeights:
    """Weights placed in shared buckets, owned by the producer until closed.

    ``handles`` is the plain description to send to a backend's
    ``update_weights_from_ipc_handles``. ``close()`` (or leaving the ``with`` block, or
    garbage collection, or interpreter exit) unlinks every shared-memory segment that a consumer
    has not already released and drops the CUDA buckets. Keep the object alive until the backend
    has consumed the handles.
    """

    def __init__(self, handles: WeightHandles, allocations: list[Allocation]):
        self.handles = handles
        self._cuda_buckets = [a.data for a in allocations if not a.path]
        segments = [a.path for a in allocations if a.path]
        self._finalizer = weakref.finalize(self, _unlink_all, segments)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Unlink the segments and drop the CUDA buckets. Idempotent."""
        self._finalizer()
        self._cuda_buckets.clear()

    def __enter__(self) -> SharedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def named_tensors(
    state_dict: Mapping[str, Entry] | Iterable[tuple[str, Entry]],
) -> NamedEntries:
    """``(name, tensor or delta)`` pairs of a state dict, tensors detached, in order.

    Raises:
        ValueError: a name repeats.
    """
    items = list(state_dict.items() if isinstance(state_dict, Mapping) else state_dict)
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("the weights name the same tensor twice")
    return [(name, _detached(entry)) for name, entry in items]


def _detached(entry: Entry) -> Entry:
    return entry if isinstance(entry, TensorDelta) else entry.detach()


def share_weights(
    state_dict: Mapping[str, Entry] | Iterable[tuple[str, Entry]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    devices: Sequence[torch.device | int | str] | None = None,
) -> SharedWeights:
    """Pack tensors into shared buckets: CPU tensors into shared memory, CUDA tensors into CUDA IPC
    buckets on their own GPU, or on each of ``devices``.

    Tensors are copied once into the buckets (the trainer may change its copies afterwards) and
    laid out in the order given, each 64-byte aligned; a bucket closes when the next tensor would
    pass ``bucket_bytes``, and a tensor larger than that gets a bucket of its own. Each bucket's
    checksum is taken as it is filled.

    Args:
        state_dict: ``{name: tensor}`` or ``(name, tensor)`` pairs, names as in the checkpoint;
            a value may be a ``TensorDelta`` (``gen_interface.weights.delta``), sent as such to
            a backend that holds its base.
        bucket_bytes: the target bucket size in bytes.
        devices: GPUs to place a full copy on, one per GPU, so that each generation worker reads
            the copy on its own GPU (CUDA IPC reaches only the same GPU): CUDA devices, indices,
            or GPU UUIDs such as a backend's ``device_ids()``. Default: the tensors' own device.

    Returns:
        A ``SharedWeights`` owning the buckets, whose ``handles`` are picklable plain data.

    Raises:
        ValueError: a name repeats, ``bucket_bytes`` < 1, or the tensors sit on several devices
            and ``devices`` is not given.
        WeightUpdateError: shared memory is full.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    tensors = named_tensors(state_dict)
    groups = plan_buckets(tensors, bucket_bytes)
    allocations: list[Allocation] = []
    buckets: list[WeightBucket] = []
    try:
        for place in resolve_places(tensors, devices):
            for group in groups:
                allocations.append(place.allocate(group_bytes(group)))
                buckets.append(fill_bucket(allocations[-1], group))
    except BaseException:
        _unlink_all([a.path for a in allocations if a.path])
        raise
    return SharedWeights(local_handles(buckets, release_after_read=True), allocations)


def _unlink_all(segments: list[str]) -> None:
    for path in segments:
        unlink_segment(path)
