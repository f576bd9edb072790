"""How tensors are laid out in buckets, and where buckets live (host memory or a GPU).

Shared by the one-shot producer (``share_weights``) and the streaming one (``BucketRing``).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from gen_interface.errors import WeightUpdateError
from gen_interface.weights.checksum import bytes_checksum, combine_checksums
from gen_interface.weights.chunked import chunk_checksums, copy_with_checksums
from gen_interface.weights.cuda_ipc import device_index, device_uuid, export_cuda_bucket
from gen_interface.weights.handles import (
    HANDLES_FORMAT,
    TensorSlot,
    WeightBucket,
    WeightHandles,
    dtype_from_name,
    dtype_name,
)
from gen_interface.weights.shm import create_segment

__all__ = [
    "Allocation",
    "NamedTensors",
    "Place",
    "describe_bucket",
    "fill_bucket",
    "local_handles",
    "pack",
    "plan_buckets",
    "resolve_places",
    "slot_view",
    "tensor_slot",
    "unpack",
    "unpack_verified",
]

NamedTensors = list[tuple[str, torch.Tensor]]

_ALIGN = 64


@dataclass(frozen=True)
class Place:
    """Where a copy of the weights lives: host shared memory (``device`` None) or one GPU."""

    device: torch.device | None

    def allocate(self, nbytes: int) -> Allocation:
        """A new bucket of ``nbytes`` here."""
        if self.device is None:
            path, data = create_segment(nbytes)
            return Allocation(self, data, path, b"")
        data = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        return Allocation(self, data, "", export_cuda_bucket(data))


@dataclass(frozen=True)
class Allocation:
    """One bucket's memory: a shared-memory segment (``path``) or a CUDA IPC-exported tensor."""

    place: Place
    data: torch.Tensor  # uint8 [capacity]
    path: str
    ipc_args: bytes

    @property
    def capacity(self) -> int:
        return int(self.data.numel())


def resolve_places(
    tensors: NamedTensors, devices: Sequence[torch.device | int | str] | None
) -> list[Place]:
    """The places a copy goes to: ``devices`` (CUDA devices, indices or GPU UUIDs), else the
    tensors' own device (host memory for CPU tensors).

    Raises:
        ValueError: ``devices`` names a non-CUDA device, or, without ``devices``, the tensors
            sit on several devices or on one that is neither CPU nor CUDA.
    """
    if devices is not None:
        return [Place(d) for d in dict.fromkeys(_cuda_device(d) for d in devices)]
    found = {tensor.device for _, tensor in tensors} or {torch.device("cpu")}
    if len(found) > 1:
        raise ValueError(
            f"weights on several devices {sorted(map(str, found))}: pass devices=[...] (a copy "
            "per GPU) or move them to one device"
        )
    device = found.pop()
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot share weights on device {device}: use CPU or CUDA tensors")
    return [Place(None if device.type == "cpu" else device)]


def plan_buckets(tensors: NamedTensors, bucket_bytes: int) -> list[NamedTensors]:
    """Cut ``tensors`` (in order) into groups of at most ``bucket_bytes`` laid out; a tensor
    larger than that is a group of its own."""
    groups: list[NamedTensors] = []
    current: NamedTensors = []
    size = 0
    for name, tensor in tensors:
        nbytes = aligned(tensor.numel() * tensor.element_size())
        if current and size + nbytes > bucket_bytes:
            groups.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        groups.append(current)
    return groups


def group_bytes(group: NamedTensors) -> int:
    """Bytes a group takes in a bucket, alignment included."""
    return sum(aligned(t.numel() * t.element_size()) for _, t in group)


def pack(data: torch.Tensor, group: NamedTensors) -> tuple[list[TensorSlot], int]:
    """Copy ``group`` (from any device) into the uint8 tensor ``data``, 64-byte aligned, and take
    each tensor's checksum as it is written (host memory: chunk by chunk, each chunk hashed
    while still in cache, ``chunked.py``).

    Returns:
        The slots describing where each tensor went, and the bytes used.

    Raises:
        ValueError: the group does not fit.
    """
    needed = group_bytes(group)
    if needed > data.numel():
        raise ValueError(f"{needed} bytes do not fit a {data.numel()}-byte bucket")
    slots: list[TensorSlot] = []
    offset = 0
    for name, tensor in group:
        nbytes = tensor.numel() * tensor.element_size()
        region = data[offset : offset + nbytes]
        source = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if region.device.type == "cpu" and source.device.type == "cpu":
            slots.append(tensor_slot(name, tensor, offset, copy_with_checksums(region, source)))
        elif region.device.type == "cpu":  # from a GPU into host memory
            region.copy_(source)
            slots.append(tensor_slot(name, tensor, offset, chunk_checksums(region)))
        else:
            region.copy_(source)
            slots.append(tensor_slot(name, tensor, offset, None, bytes_checksum(region)))
        offset += aligned(nbytes)
    return slots, offset


def unpack(data: torch.Tensor, slots: Sequence[TensorSlot]) -> NamedTensors:
    """``(name, tensor)`` views of a packed bucket (no copy, no verification)."""
    return [(slot["name"], slot_view(data, slot)) for slot in slots]


def unpack_verified(
    data: torch.Tensor, slots: Sequence[TensorSlot]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of a packed bucket, each verified against its slot's checksum
    just before it is yielded: a consumer that writes each tensor as it comes reads its bytes
    twice while they are in cache, not from memory.

    Raises:
        WeightUpdateError: a tensor's bytes differ from what the producer wrote; the tensors
            yielded before it were intact.
    """
    for slot in slots:
        view = data[slot["offset"] : slot["offset"] + slot["nbytes"]]
        if bytes_checksum(view) != slot["checksum"]:
            raise WeightUpdateError(
                f"weight {slot['name']!r} changed after it was shared or sent (checksum "
                "mismatch): the producer must not write to a bucket until it is loaded"
            )
        yield slot["name"], slot_view(data, slot)


def slot_view(data: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """The tensor a slot describes, viewing ``data``."""
    region = data[slot["offset"] : slot["offset"] + slot["nbytes"]]
    return region.view(dtype_from_name(slot["dtype"])).view(slot["shape"])


def fill_bucket(allocation: Allocation, group: NamedTensors) -> WeightBucket:
    """Copy ``group`` into ``allocation`` (from any device) and describe the bucket.

    Each tensor's checksum is taken right after it is written; the bucket's combines them.
    """
    slots, offset = pack(allocation.data, group)
    return describe_bucket(allocation, offset, slots)


def tensor_slot(
    name: str,
    tensor: torch.Tensor,
    offset: int,
    chunks: list[int] | None,
    checksum: int | None = None,
) -> TensorSlot:
    """The slot of ``tensor`` at ``offset``: host bytes with their chunk checksums (``checksum``
    combines them), or device bytes with their ``checksum``."""
    slot = TensorSlot(
        name=name,
        dtype=dtype_name(tensor.dtype),
        shape=list(tensor.shape),
        offset=offset,
        nbytes=tensor.numel() * tensor.element_size(),
        checksum=combine_checksums(chunks) if chunks is not None else int(checksum or 0),
    )
    if chunks is not None:
        slot["chunks"] = chunks
    return slot


def describe_bucket(allocation: Allocation, nbytes: int, slots: list[TensorSlot]) -> WeightBucket:
    """The bucket of ``slots``, the first ``nbytes`` of ``allocation``."""
    device = allocation.place.device
    return WeightBucket(
        transport="shm" if device is None else "cuda_ipc",
        location=allocation.path,
        ipc_args=allocation.ipc_args,
        device_uuid="" if device is None else device_uuid(device),
        nbytes=nbytes,
        checksum=combine_checksums(slot["checksum"] for slot in slots),
        tensors=slots,
    )


def aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def local_handles(buckets: list[WeightBucket], *, release_after_read: bool) -> WeightHandles:
    """Handles to ``buckets`` made by this process, on this host."""
    return WeightHandles(
        format=HANDLES_FORMAT,
        host=host_name(),
        buckets=buckets,
        release_after_read=release_after_read,
    )


def host_name() -> str:
    return socket.gethostname()


def _cuda_device(device: torch.device | int | str) -> torch.device:
    """A CUDA device from a device, an index or a GPU UUID (``"GPU-..."``)."""
    if isinstance(device, str) and device.startswith("GPU-"):
        return torch.device("cuda", device_index(device))
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type != "cuda":
        raise ValueError(f"devices=... takes CUDA devices, indices or GPU UUIDs, got {device!r}")
    return resolved
