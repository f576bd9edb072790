"""How tensors are laid out in buckets, and where buckets live (host memory or a GPU).

Shared by the one-shot producer (``share_weights``) and the streaming one (``BucketRing``).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from gen_interface.errors import WeightUpdateError
from gen_interface.weights.checksum import bytes_checksum, combine_checksums
from gen_interface.weights.chunked import chunk_checksums, copy_with_checksums
from gen_interface.weights.cuda_ipc import device_index, device_uuid, export_cuda_bucket
from gen_interface.weights.delta import TensorDelta
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
    "Entry",
    "NamedEntries",
    "NamedTensors",
    "Place",
    "describe_bucket",
    "entry_bytes",
    "fill_bucket",
    "iter_buckets",
    "local_handles",
    "pack",
    "plan_buckets",
    "resolve_places",
    "slot_view",
    "tensor_slot",
    "unpack",
    "unpack_entries",
    "unpack_verified",
]

NamedTensors = list[tuple[str, torch.Tensor]]
#: What a bucket holds of one weight: the tensor itself, or a delta against the receiver's base.
Entry = torch.Tensor | TensorDelta
NamedEntries = list[tuple[str, Entry]]

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
    tensors: Sequence[tuple[str, Entry]], devices: Sequence[torch.device | int | str] | None
) -> list[Place]:
    """The places a copy goes to: ``devices`` (CUDA devices, indices or GPU UUIDs), else the
    tensors' own device (host memory for CPU tensors).

    Raises:
        ValueError: ``devices`` names a non-CUDA device, or, without ``devices``, the tensors
            sit on several devices or on one that is neither CPU nor CUDA.
    """
    if devices is not None:
        return [Place(d) for d in dict.fromkeys(_cuda_device(d) for d in devices)]
    found = {_device(entry) for _, entry in tensors} or {torch.device("cpu")}
    if len(found) > 1:
        raise ValueError(
            f"weights on several devices {sorted(map(str, found))}: pass devices=[...] (a copy "
            "per GPU) or move them to one device"
        )
    device = found.pop()
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot share weights on device {device}: use CPU or CUDA tensors")
    return [Place(None if device.type == "cpu" else device)]


def plan_buckets(tensors: Iterable[tuple[str, Entry]], bucket_bytes: int) -> list[NamedEntries]:
    """Cut ``tensors`` (in order) into groups of at most ``bucket_bytes`` laid out; a tensor
    larger than that is a group of its own. A delta counts its own bytes (and a group of
    deltas ends once they stand for ``DELTA_SPAN_BYTES`` of weights)."""
    return list(iter_buckets(tensors, bucket_bytes))


#: A bucket closes once its deltas stand for this many bytes of weights, however few bytes they
#: encode: a receiver applies and loads each bucket while the trainer makes the next one's
#: deltas, which one bucket holding a whole model's deltas would leave no room for.
DELTA_SPAN_BYTES = 32 * 2**20


def iter_buckets(tensors: Iterable[tuple[str, Entry]], bucket_bytes: int) -> Iterator[NamedEntries]:
    """``plan_buckets``, each group made once the entries it holds were made (entries made on
    demand, such as deltas, are then made one bucket ahead of the one being filled). A group
    also ends once its deltas stand for ``DELTA_SPAN_BYTES`` of weights."""
    current: NamedEntries = []
    size = span = 0
    for name, entry in tensors:
        nbytes = aligned(entry_bytes(entry))
        if current and (size + nbytes > bucket_bytes or span >= DELTA_SPAN_BYTES):
            yield current
            current, size, span = [], 0, 0
        current.append((name, entry))
        size += nbytes
        if isinstance(entry, TensorDelta):
            span += entry.whole_bytes
    if current:
        yield current


def entry_bytes(entry: Entry) -> int:
    """Bytes an entry puts in a bucket: a tensor's, or a delta's encoded ones."""
    if isinstance(entry, TensorDelta):
        return entry.nbytes
    return entry.numel() * entry.element_size()


def group_bytes(group: Sequence[tuple[str, Entry]]) -> int:
    """Bytes a group takes in a bucket, alignment included."""
    return sum(aligned(entry_bytes(entry)) for _, entry in group)


def pack(data: torch.Tensor, group: Sequence[tuple[str, Entry]]) -> tuple[list[TensorSlot], int]:
    """Copy ``group`` (from any device) into the uint8 tensor ``data``, 64-byte aligned, and take
    each tensor's checksum as it is written (host memory: chunk by chunk, each chunk hashed
    while still in cache, ``chunked.py``). A delta's slot holds its encoded bytes, their
    checksum, and the delta's fields.

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
    for name, entry in group:
        nbytes = entry_bytes(entry)
        region = data[offset : offset + nbytes]
        tensor = entry.payload if isinstance(entry, TensorDelta) else entry
        source = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if region.device.type == "cpu" and source.device.type == "cpu":
            slot = tensor_slot(name, tensor, offset, copy_with_checksums(region, source))
        elif region.device.type == "cpu":  # from a GPU into host memory
            region.copy_(source)
            slot = tensor_slot(name, tensor, offset, chunk_checksums(region))
        else:
            region.copy_(source)
            slot = tensor_slot(name, tensor, offset, None, bytes_checksum(region))
        if isinstance(entry, TensorDelta):
            slot["dtype"] = dtype_name(entry.dtype)
            slot["shape"] = list(entry.shape)
            slot["delta"] = entry.describe()
        slots.append(slot)
        offset += aligned(nbytes)
    return slots, offset


def unpack(data: torch.Tensor, slots: Sequence[TensorSlot]) -> NamedTensors:
    """``(name, tensor)`` views of a packed bucket (no copy, no verification).

    Raises:
        WeightUpdateError: a slot holds a delta (``unpack_entries`` reads those).
    """
    return [(slot["name"], slot_view(data, slot)) for slot in slots]


def unpack_verified(
    data: torch.Tensor, slots: Sequence[TensorSlot]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of a packed bucket, each verified against its slot's checksum
    just before it is yielded: a consumer that writes each tensor as it comes reads its bytes
    twice while they are in cache, not from memory.

    Raises:
        WeightUpdateError: a tensor's bytes differ from what the producer wrote (the tensors
            yielded before it were intact), or a slot holds a delta, which a receiver without
            a base cannot take (``unpack_entries`` reads those).
    """
    for slot, entry in unpack_entries(data, slots):
        if isinstance(entry, TensorDelta):
            raise WeightUpdateError(
                f"weight {slot['name']!r} arrived as a delta, and this receiver keeps no base "
                "to apply it to: send whole tensors (Refitter(..., deltas=False))"
            )
        yield slot["name"], entry


def unpack_entries(
    data: torch.Tensor, slots: Sequence[TensorSlot]
) -> Iterator[tuple[TensorSlot, Entry]]:
    """``(slot, tensor or delta)`` of every slot of a packed bucket, viewing ``data``, each
    verified against its slot's checksum just before it is yielded (a delta's encoded bytes,
    not yet the tensor it makes).

    Raises:
        WeightUpdateError: bytes differ from what the producer wrote (the entries yielded
            before were intact), or a delta's fields are malformed.
    """
    for slot in slots:
        view = data[slot["offset"] : slot["offset"] + slot["nbytes"]]
        if bytes_checksum(view) != slot["checksum"]:
            raise WeightUpdateError(
                f"weight {slot['name']!r} changed after it was shared or sent (checksum "
                "mismatch): the producer must not write to a bucket until it is loaded"
            )
        if "delta" in slot:
            yield slot, TensorDelta.from_slot(view, slot["delta"], slot["shape"], slot["dtype"])
        else:
            yield slot, slot_view(data, slot)


def slot_view(data: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """The tensor a slot describes, viewing ``data``.

    Raises:
        WeightUpdateError: the slot holds a delta, not the tensor.
    """
    if "delta" in slot:
        raise WeightUpdateError(
            f"weight {slot['name']!r} arrived as a delta, and this receiver keeps no base to "
            "apply it to: send whole tensors (Refitter(..., deltas=False))"
        )
    region = data[slot["offset"] : slot["offset"] + slot["nbytes"]]
    return region.view(dtype_from_name(slot["dtype"])).view(slot["shape"])


def fill_bucket(allocation: Allocation, group: Sequence[tuple[str, Entry]]) -> WeightBucket:
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


def _device(entry: Entry) -> torch.device:
    return entry.payload.device if isinstance(entry, TensorDelta) else entry.device


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
