"""Producer side: a trainer's state dict becomes a few large shared buckets and plain handles."""

from __future__ import annotations

import socket
import weakref
from collections.abc import Iterable, Mapping, Sequence

import torch

from gen_interface.weights.checksum import bytes_checksum
from gen_interface.weights.cuda_ipc import device_index, device_uuid, export_cuda_bucket
from gen_interface.weights.handles import (
    HANDLES_FORMAT,
    TensorSlot,
    WeightBucket,
    WeightHandles,
    dtype_name,
)
from gen_interface.weights.shm import create_segment, unlink_segment

__all__ = ["DEFAULT_BUCKET_BYTES", "SharedWeights", "share_weights"]

#: Bucket size: large enough that a model is a handful of buckets, small enough to stage.
DEFAULT_BUCKET_BYTES = 512 * 2**20
_ALIGN = 64


class SharedWeights:
    """Weights placed in shared buckets, owned by the producer until closed.

    ``handles`` is the plain description to send to a backend's
    ``update_weights_from_ipc_handles``. ``close()`` (or leaving the ``with`` block, or
    garbage collection, or interpreter exit) unlinks every shared-memory segment that a consumer
    has not already released and drops the CUDA buckets. Keep the object alive until the backend
    has consumed the handles.
    """

    def __init__(
        self, handles: WeightHandles, segments: list[str], cuda_buckets: list[torch.Tensor]
    ):
        self.handles = handles
        self._cuda_buckets = cuda_buckets
        self._finalizer = weakref.finalize(self, _unlink_all, list(segments))

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


def share_weights(
    state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    devices: Sequence[torch.device | int | str] | None = None,
) -> SharedWeights:
    """Pack tensors into shared buckets: CPU tensors into shared memory, CUDA tensors into CUDA IPC
    buckets on their own GPU, or on each of ``devices``.

    Tensors are copied once into the buckets (the trainer may change its copies afterwards) and
    laid out in the order given, each 64-byte aligned; a bucket closes when the next tensor would
    pass ``bucket_bytes``, and a tensor larger than that gets a bucket of its own.

    Args:
        state_dict: ``{name: tensor}`` or ``(name, tensor)`` pairs, names as in the checkpoint.
        bucket_bytes: the target bucket size in bytes.
        devices: GPUs to place a full copy on, one per GPU, so that each generation worker reads
            the copy on its own GPU (CUDA IPC reaches only the same GPU): CUDA devices, indices,
            or GPU UUIDs such as a backend's ``device_ids()``. Default: each tensor stays on its
            own device.

    Returns:
        A ``SharedWeights`` owning the buckets, whose ``handles`` are picklable plain data.

    Raises:
        ValueError: a name repeats, or ``bucket_bytes`` < 1.
        WeightUpdateError: shared memory is full.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    items = list(state_dict.items() if isinstance(state_dict, Mapping) else state_dict)
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("share_weights got the same tensor name twice")

    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    if devices is None:
        for name, tensor in items:
            by_device.setdefault(tensor.device, []).append((name, tensor.detach()))
    else:
        for device in dict.fromkeys(_cuda_device(d) for d in devices):
            by_device[device] = [(name, tensor.detach()) for name, tensor in items]

    buckets: list[WeightBucket] = []
    segments: list[str] = []
    cuda_buckets: list[torch.Tensor] = []
    try:
        for device, tensors in by_device.items():
            for group in _plan_buckets(tensors, bucket_bytes):
                slots, total = _layout(group)
                if device.type == "cuda":
                    data = torch.zeros(total, dtype=torch.uint8, device=device)
                    _fill(data, group, slots)
                    cuda_buckets.append(data)
                    location, ipc_args, uuid = "", export_cuda_bucket(data), device_uuid(device)
                elif device.type == "cpu":
                    location, data = create_segment(total)
                    segments.append(location)
                    _fill(data, group, slots)
                    ipc_args, uuid = b"", ""
                else:
                    raise ValueError(
                        f"cannot share weights on device {device}: use CPU or CUDA tensors"
                    )
                buckets.append(
                    WeightBucket(
                        transport="cuda_ipc" if device.type == "cuda" else "shm",
                        location=location,
                        ipc_args=ipc_args,
                        device_uuid=uuid,
                        nbytes=total,
                        checksum=bytes_checksum(data),
                        tensors=slots,
                    )
                )
    except BaseException:
        _unlink_all(segments)
        raise
    handles = WeightHandles(format=HANDLES_FORMAT, host=socket.gethostname(), buckets=buckets)
    return SharedWeights(handles, segments, cuda_buckets)


def _cuda_device(device: torch.device | int | str) -> torch.device:
    """A CUDA device from a device, an index or a GPU UUID (``"GPU-..."``)."""
    if isinstance(device, str) and device.startswith("GPU-"):
        return torch.device("cuda", device_index(device))
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type != "cuda":
        raise ValueError(f"share_weights(devices=...) takes CUDA devices, got {device!r}")
    return resolved


def _plan_buckets(
    tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    groups: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in tensors:
        nbytes = _aligned(tensor.numel() * tensor.element_size())
        if current and size + nbytes > bucket_bytes:
            groups.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        groups.append(current)
    return groups


def _layout(group: list[tuple[str, torch.Tensor]]) -> tuple[list[TensorSlot], int]:
    slots: list[TensorSlot] = []
    offset = 0
    for name, tensor in group:
        nbytes = tensor.numel() * tensor.element_size()
        slots.append(
            TensorSlot(
                name=name,
                dtype=dtype_name(tensor.dtype),
                shape=list(tensor.shape),
                offset=offset,
                nbytes=nbytes,
            )
        )
        offset += _aligned(nbytes)
    return slots, offset


def _fill(
    data: torch.Tensor, group: list[tuple[str, torch.Tensor]], slots: list[TensorSlot]
) -> None:
    for (_, tensor), slot in zip(group, slots, strict=True):
        if slot["nbytes"]:
            source = tensor.contiguous().reshape(-1).view(torch.uint8)
            data[slot["offset"] : slot["offset"] + slot["nbytes"]].copy_(source)  # across GPUs too


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def _unlink_all(segments: list[str]) -> None:
    for path in segments:
        unlink_segment(path)
