"""The plain, picklable description of shared weights that crosses process boundaries.

Handles hold only str, int, bytes, lists and dicts, so they pass through Ray, pickle and msgspec
alike; tensors are rebuilt on the consumer side from the names, dtypes, shapes and offsets here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NotRequired, TypedDict

import torch

from gen_interface.errors import WeightUpdateError

__all__ = [
    "HANDLES_FORMAT",
    "DeltaSlot",
    "LoadSize",
    "TensorSlot",
    "WeightBase",
    "WeightBucket",
    "WeightHandles",
    "bucket_place",
    "describe_slots",
    "describe_weight_handles",
    "dtype_from_name",
    "dtype_name",
    "handles_from_json",
    "handles_to_json",
]

HANDLES_FORMAT = 3

BucketTransport = Literal["shm", "cuda_ipc"]


class DeltaSlot(TypedDict):
    """A tensor sent as a delta (``gen_interface.weights.delta``): what its slot's bytes encode
    and the base they apply to."""

    encoding: str  # "xor-sparse"
    count: int  # elements changed
    block: int  # 256 or 65536: elements per block of the positions
    planes: int  # low bytes kept of each change's XOR
    wide: int  # changes whose XOR needs more bytes, listed whole
    base_version: int  # the committed weight version the delta applies to
    base_checksum: int  # bytes_checksum of that base tensor (host XXH3)
    checksum: int  # bytes_checksum of the tensor the delta makes: the trainer's own


class TensorSlot(TypedDict):
    """One tensor inside a bucket: ``nbytes`` bytes at ``offset``, viewed as ``dtype[shape]``,
    or, for a slot with ``delta``, the delta's encoded bytes (``nbytes`` of them) that turn the
    receiver's base of that tensor into ``dtype[shape]``."""

    name: str  # checkpoint (Hugging Face) name, e.g. "model.layers.0.mlp.up_proj.weight"
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: list[int]
    offset: int  # bytes from the start of the bucket, 64-byte aligned
    nbytes: int
    checksum: int  # bytes_checksum of these bytes, taken right after they were written
    # Host buckets: the checksum of every CHUNK_BYTES chunk (``checksum`` combines them), so a
    # consumer can verify each chunk just before copying it, while it is in cache.
    chunks: NotRequired[list[int]]
    # Present when the slot holds a delta: ``checksum`` and ``chunks`` then cover the delta's
    # bytes, and ``delta["checksum"]`` the whole tensor it makes.
    delta: NotRequired[DeltaSlot]


class WeightBucket(TypedDict):
    """One contiguous block of bytes holding several tensors.

    ``shm`` buckets name a shared-memory file on ``WeightHandles.host``; ``cuda_ipc`` buckets
    carry the pickled arguments of torch's CUDA IPC rebuild and the UUID of their GPU.
    """

    transport: BucketTransport
    location: str  # shm: path of the segment; cuda_ipc: "" (see ipc_args)
    ipc_args: bytes  # cuda_ipc: pickled rebuild arguments; shm: b""
    device_uuid: str  # cuda_ipc: the GPU's UUID; shm: ""
    nbytes: int
    checksum: int  # combine_checksums of its slots' checksums, in order
    tensors: list[TensorSlot]


class WeightHandles(TypedDict):
    """Everything a consumer needs to read the weights a producer shared."""

    format: int  # HANDLES_FORMAT
    host: str  # host name of the producer (shm segments are only reachable there)
    buckets: list[WeightBucket]
    # True: the consumer unlinks the segments once read (share_weights); False: the producer
    # reuses them for the next bucket and removes them itself (a streaming refit's ring).
    release_after_read: bool


class WeightBase(TypedDict):
    """The committed weights a backend can take deltas against (``weight_base()``).

    A trainer sends a tensor as a delta only when its own record of the last version it sent
    has this version and this checksum; anything else gets whole tensors.
    """

    version: int | None  # the committed version the receiver's copy holds; None: none yet
    checksum: int  # named_checksums of every tensor's bytes_checksum (0 when version is None)
    dtypes: dict[str, str]  # each weight's dtype there: deltas are taken in it


_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}


@dataclass(frozen=True)
class LoadSize:
    """What some loads carried: tensors, how many as deltas, and their bytes.

    Attributes:
        tensors: tensors carried.
        deltas: of them, sent as deltas.
        whole_bytes: bytes of the whole tensors they stand for.
        sent_bytes: bytes that crossed the transport (a delta's own bytes, not its tensor's).
    """

    tensors: int = 0
    deltas: int = 0
    whole_bytes: int = 0
    sent_bytes: int = 0

    @classmethod
    def of_slots(cls, slots: Iterable[Mapping[str, Any]]) -> LoadSize:
        """The size of the slots of one bucket (already described: ``describe_slots``)."""
        tensors = deltas = whole = sent = 0
        for slot in slots:
            numel = torch.Size(slot["shape"]).numel()
            tensors += 1
            deltas += "delta" in slot
            whole += numel * dtype_from_name(slot["dtype"]).itemsize
            sent += int(slot["nbytes"])
        return cls(tensors, deltas, whole, sent)

    def __add__(self, other: LoadSize) -> LoadSize:
        return LoadSize(
            self.tensors + other.tensors,
            self.deltas + other.deltas,
            self.whole_bytes + other.whole_bytes,
            self.sent_bytes + other.sent_bytes,
        )


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``.

    Raises:
        WeightUpdateError: the name is not a dtype weights can be shared in.
    """
    try:
        return _DTYPES[name]
    except KeyError:
        raise WeightUpdateError(
            f"weight handles use dtype {name!r}, which is not one of {sorted(_DTYPES)}"
        ) from None


def bucket_place(bucket: Mapping[str, Any]) -> str:
    """Where a bucket lives: its GPU's UUID for CUDA IPC buckets, ``"host"`` for shared memory.

    Handles may hold one full copy of the weights per place (``share_weights(devices=...)``), so
    that every worker reads the copy on its own GPU.
    """
    return str(bucket["device_uuid"]) if bucket["transport"] == "cuda_ipc" else "host"


def describe_slots(
    slots: Iterable[Mapping[str, Any]], nbytes: int | None = None
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``{name: (shape, dtype)}`` of one bucket's slots, checked for consistency.

    A slot holding a delta is described by the whole tensor it makes; its ``nbytes`` are the
    delta's own.

    Args:
        slots: the bucket's ``TensorSlot`` entries.
        nbytes: the bucket's size, when known: every slot must lie inside it.

    Raises:
        WeightUpdateError: a slot is malformed, names a tensor twice, has a byte count that does
            not fit its dtype and shape, or lies outside the bucket.
    """
    out: dict[str, tuple[torch.Size, torch.dtype]] = {}
    try:
        for slot in slots:
            name = slot["name"]
            if name in out:
                raise WeightUpdateError(f"a weight bucket carries {name!r} twice")
            dtype = dtype_from_name(slot["dtype"])
            shape = torch.Size(slot["shape"])
            if "delta" not in slot and slot["nbytes"] != shape.numel() * dtype.itemsize:
                raise WeightUpdateError(
                    f"a weight bucket gives {name!r} {slot['nbytes']} bytes, but "
                    f"{dtype_name(dtype)}{list(shape)} needs {shape.numel() * dtype.itemsize}"
                )
            end = slot["offset"] + slot["nbytes"]
            if slot["offset"] < 0 or (nbytes is not None and end > nbytes):
                raise WeightUpdateError(f"a weight bucket places {name!r} outside itself")
            out[name] = (shape, dtype)
    except (KeyError, TypeError) as exc:
        raise WeightUpdateError(
            f"a weight bucket is malformed: missing or bad field {exc}"
        ) from exc
    return out


def describe_weight_handles(
    handles: Mapping[str, Any],
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``{name: (shape, dtype)}`` of every tensor the handles carry, without reading any bytes.

    When the handles hold a copy per place (several GPUs, or GPUs and host memory), every copy
    must carry the same tensors; the description is that of one copy.

    Raises:
        WeightUpdateError: the handles are malformed, of another format, name a tensor twice in
            one place, or hold copies that differ.
    """
    if not isinstance(handles, Mapping) or handles.get("format") != HANDLES_FORMAT:
        got = handles.get("format") if isinstance(handles, Mapping) else type(handles).__name__
        raise WeightUpdateError(
            f"weight handles must come from gen_interface.weights.share_weights "
            f"(format {HANDLES_FORMAT}), got format {got!r}"
        )
    places: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = {}
    try:
        for bucket in handles["buckets"]:
            out = places.setdefault(bucket_place(bucket), {})
            for name, spec in describe_slots(bucket["tensors"], bucket["nbytes"]).items():
                if name in out:
                    raise WeightUpdateError(
                        f"weight handles carry {name!r} twice in {bucket_place(bucket)}"
                    )
                out[name] = spec
    except (KeyError, TypeError) as exc:
        raise WeightUpdateError(
            f"weight handles are malformed: missing or bad field {exc}"
        ) from exc
    copies = list(places.items())
    if not copies:
        return {}
    first_place, first = copies[0]
    for place, specs in copies[1:]:
        if specs != first:
            raise WeightUpdateError(
                f"weight handles hold different tensors in {first_place} and in {place}: every "
                "place must hold a full copy of the same weights"
            )
    return first


def handles_to_json(handles: Mapping[str, Any]) -> dict[str, Any]:
    """``handles`` as JSON-ready data (``ipc_args`` bytes as base64 text), for an HTTP server."""
    import base64

    out = dict(handles)
    out["buckets"] = [
        {**bucket, "ipc_args": base64.b64encode(bucket.get("ipc_args", b"")).decode()}
        for bucket in handles["buckets"]
    ]
    return out


def handles_from_json(data: Mapping[str, Any]) -> WeightHandles:
    """What ``handles_to_json`` wrote, back as ``WeightHandles`` (checked when they are read).

    Raises:
        WeightUpdateError: the data is not handles.
    """
    import base64
    import binascii

    buckets = data.get("buckets")
    if not isinstance(buckets, list) or not all(isinstance(b, Mapping) for b in buckets):
        raise WeightUpdateError("weight handles need a list of `buckets`")
    try:
        decoded = [
            {**bucket, "ipc_args": base64.b64decode(str(bucket.get("ipc_args", "")))}
            for bucket in buckets
        ]
    except (binascii.Error, ValueError) as exc:
        raise WeightUpdateError(f"a bucket's ipc_args is not base64: {exc}") from exc
    return {**dict(data), "buckets": decoded}  # type: ignore[typeddict-item]
