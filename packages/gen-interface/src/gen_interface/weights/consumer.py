"""Consumer side: what a backend calls to read weights shared by ``share_weights``."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gen_interface.errors import WeightUpdateError
from gen_interface.weights.checksum import bytes_checksum
from gen_interface.weights.cuda_ipc import import_cuda_bucket
from gen_interface.weights.handles import (
    HANDLES_FORMAT,
    WeightBucket,
    WeightHandles,
    bucket_place,
    describe_weight_handles,
    dtype_from_name,
    dtype_name,
)
from gen_interface.weights.shm import map_segment, unlink_segment

__all__ = [
    "TensorSpecs",
    "check_weights_match",
    "handles_for_device",
    "merge_weight_handles",
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


def handles_for_device(handles: Mapping[str, Any], device_uuid: str | None) -> dict[str, Any]:
    """The copy of the weights a worker reads: the one on its own GPU, else the one in host
    memory.

    Args:
        handles: ``SharedWeights.handles``, perhaps merged from several producers.
        device_uuid: the worker's GPU (``"GPU-..."``), or None for a worker on the CPU.

    Raises:
        WeightUpdateError: no copy is on this GPU and none is in host memory; the message says
            how to share so that every worker finds one.
    """
    buckets = handles["buckets"]
    if device_uuid is not None:
        here = [b for b in buckets if bucket_place(b) == device_uuid]
        if here:
            return {**handles, "buckets": here}
    host = [b for b in buckets if b["transport"] == "shm"]
    if host or not buckets:
        return {**handles, "buckets": host}
    on = sorted({b["device_uuid"] for b in buckets})
    raise WeightUpdateError(
        f"weights were shared on GPUs {on}, and this worker runs on "
        f"{device_uuid or 'the CPU'}: CUDA IPC reaches only a process on the same GPU. Share a "
        "copy on every generation GPU (share_weights(state_dict, devices=backend's device ids)), "
        "merge the handles of trainer ranks on those GPUs (merge_weight_handles), or share CPU "
        "tensors (host memory reaches every worker on the machine)"
    )


def merge_weight_handles(parts: Sequence[Mapping[str, Any]]) -> WeightHandles:
    """One set of handles from several producers, e.g. each trainer rank sharing on its own GPU.

    Each part keeps its places (GPUs, host memory); a place may come from one part only.

    Raises:
        WeightUpdateError: the parts come from different hosts, or two of them hold a copy in
            the same place, or their copies differ (see ``describe_weight_handles``).
    """
    if not parts:
        raise WeightUpdateError("merge_weight_handles needs at least one set of handles")
    hosts = {part["host"] for part in parts}
    if len(hosts) > 1:
        raise WeightUpdateError(f"cannot merge weight handles shared on different hosts {hosts}")
    seen: dict[str, int] = {}
    buckets: list[WeightBucket] = []
    for index, part in enumerate(parts):
        describe_weight_handles(part)
        for place in {bucket_place(b) for b in part["buckets"]}:
            if place in seen:
                raise WeightUpdateError(
                    f"handles {seen[place]} and {index} both hold weights in {place}"
                )
            seen[place] = index
        buckets.extend(part["buckets"])
    merged = WeightHandles(format=HANDLES_FORMAT, host=hosts.pop(), buckets=buckets)
    describe_weight_handles(merged)
    return merged


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
