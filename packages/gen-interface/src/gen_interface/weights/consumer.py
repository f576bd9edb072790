"""Consumer side: what a backend calls to read weights shared by ``share_weights``."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

import torch

from gen_interface.errors import WeightUpdateError
from gen_interface.weights.checksum import bytes_checksum
from gen_interface.weights.cuda_ipc import import_cuda_bucket
from gen_interface.weights.handles import describe_weight_handles, dtype_from_name, dtype_name
from gen_interface.weights.shm import map_segment, unlink_segment

__all__ = [
    "TensorSpecs",
    "check_weights_match",
    "handles_for_device",
    "read_shared_weights",
    "release_shared_weights",
]

TensorSpecs = Mapping[str, tuple[torch.Size, torch.dtype]]

_MAX_LISTED = 5


def check_weights_match(incoming: TensorSpecs, model: TensorSpecs) -> None:
    """Refuse an update that does not fit the model, before anything is written.

    Every incoming name must exist in the model with the same shape and dtype; the update may
    carry a subset of the model's tensors.

    Raises:
        WeightUpdateError: listing the unknown names and the shape or dtype mismatches.
    """
    problems: list[str] = []
    for name, (shape, dtype) in incoming.items():
        if name not in model:
            problems.append(f"{name!r} is not a weight of the model")
            continue
        want_shape, want_dtype = model[name]
        if tuple(shape) != tuple(want_shape):
            problems.append(f"{name!r} has shape {list(shape)}, the model's is {list(want_shape)}")
        if dtype != want_dtype:
            problems.append(
                f"{name!r} is {dtype_name(dtype)}, the model's is {dtype_name(want_dtype)}"
            )
    if problems:
        more = len(problems) - _MAX_LISTED
        listed = "; ".join(problems[:_MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")
        raise WeightUpdateError(f"weight update refused, nothing was written: {listed}")


def read_shared_weights(
    handles: Mapping[str, Any],
    expected: TensorSpecs | None = None,
    *,
    verify: bool = True,
) -> list[tuple[str, torch.Tensor]]:
    """Map the shared buckets and return ``(name, tensor)`` views of every weight, in order.

    Nothing is copied: each tensor views its bucket (shared memory or CUDA IPC), which stays
    mapped while any view lives. Segments are not unlinked here, because several workers may read
    the same handles; the backend calls ``release_shared_weights`` once all have.

    Args:
        handles: ``SharedWeights.handles``.
        expected: the model's ``{name: (shape, dtype)}``; checked before any bucket is mapped.
        verify: check each bucket's bytes against the checksum the producer recorded.

    Raises:
        WeightUpdateError: malformed handles, a mismatch with ``expected``, a segment that is
            gone or on another host, or a bucket whose bytes changed since it was shared.
    """
    specs = describe_weight_handles(handles)
    if expected is not None:
        check_weights_match(specs, expected)
    out: list[tuple[str, torch.Tensor]] = []
    for index, bucket in enumerate(handles["buckets"]):
        data = _map_bucket(handles, bucket)
        if verify and bytes_checksum(data) != bucket["checksum"]:
            raise WeightUpdateError(
                f"weight bucket {index} changed after it was shared (checksum mismatch): the "
                "producer must not write to shared buckets until the update is consumed"
            )
        for slot in bucket["tensors"]:
            view = data[slot["offset"] : slot["offset"] + slot["nbytes"]]
            out.append(
                (slot["name"], view.view(dtype_from_name(slot["dtype"])).view(slot["shape"]))
            )
    return out


def handles_for_device(handles: Mapping[str, Any], device_uuid: str) -> dict[str, Any]:
    """The part of ``handles`` a worker on the GPU ``device_uuid`` reads.

    A trainer with weights on several GPUs shares each GPU's copy as CUDA IPC buckets; a worker
    maps only the buckets of its own GPU. Shared-memory buckets are kept for everyone.

    Raises:
        WeightUpdateError: the handles hold CUDA buckets, none of them on this GPU.
    """
    buckets = [
        b
        for b in handles["buckets"]
        if b["transport"] != "cuda_ipc" or b["device_uuid"] == device_uuid
    ]
    cuda = [b for b in handles["buckets"] if b["transport"] == "cuda_ipc"]
    if cuda and not any(b["transport"] == "cuda_ipc" for b in buckets):
        on = sorted({b["device_uuid"] for b in cuda})
        raise WeightUpdateError(
            f"weights were shared on GPUs {on}, none of them this worker's GPU {device_uuid}"
        )
    return {**handles, "buckets": buckets}


def release_shared_weights(handles: Mapping[str, Any]) -> int:
    """Unlink the shared-memory segments of ``handles`` (views already mapped stay valid).

    Idempotent. CUDA buckets are freed by their producer. Returns the number of segments removed.
    """
    removed = 0
    for bucket in handles.get("buckets", []):
        if bucket.get("transport") == "shm" and bucket.get("location"):
            removed += unlink_segment(bucket["location"])
    return removed


def _map_bucket(handles: Mapping[str, Any], bucket: Mapping[str, Any]) -> torch.Tensor:
    if bucket["transport"] == "shm":
        here = socket.gethostname()
        if handles["host"] != here:
            raise WeightUpdateError(
                f"weights were shared in memory on host {handles['host']!r}, but this worker "
                f"runs on {here!r}: shared memory only reaches processes on the same machine"
            )
        return map_segment(bucket["location"], bucket["nbytes"])
    if bucket["transport"] == "cuda_ipc":
        return import_cuda_bucket(bucket["ipc_args"], bucket["device_uuid"])
    raise WeightUpdateError(f"unknown weight bucket transport {bucket['transport']!r}")
