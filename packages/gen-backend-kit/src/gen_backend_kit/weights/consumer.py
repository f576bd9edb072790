"""Consumer side: what a backend calls to read weights shared by ``share_weights``."""

from __future__ import annotations

import socket
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from gen_interface.errors import WeightUpdateError
from gen_interface.weights.checksum import combine_checksums
from gen_interface.weights.chunked import verified_copy
from gen_interface.weights.cuda_ipc import import_cuda_bucket
from gen_interface.weights.delta import TensorDelta
from gen_interface.weights.handles import (
    HANDLES_FORMAT,
    WeightBucket,
    WeightHandles,
    bucket_place,
    describe_weight_handles,
    dtype_from_name,
    dtype_name,
)
from gen_interface.weights.layout import unpack, unpack_entries, unpack_verified
from gen_interface.weights.shm import map_segment, unlink_segment

if TYPE_CHECKING:
    from gen_backend_kit.weights.committed import CommittedWeights

__all__ = [
    "TensorSpecs",
    "check_update_is_complete",
    "check_weights_match",
    "delta_bases",
    "handles_checksum",
    "handles_for_device",
    "map_bucket",
    "merge_weight_handles",
    "read_shared_weights",
    "release_shared_weights",
    "state_dict_specs",
    "write_shared_weights",
]

TensorSpecs = Mapping[str, tuple[torch.Size, torch.dtype]]

_MAX_LISTED = 5


def check_weights_match(incoming: TensorSpecs, model: TensorSpecs) -> None:
    """Refuse tensors that do not fit the model, before anything is written.

    Every incoming name must exist in the model with the same shape. Floating-point tensors may
    come in another floating-point dtype (float32 master weights for a bfloat16 engine): they
    are cast on write. Any other dtype difference is refused. Completeness is checked by
    ``check_update_is_complete``.

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
        if dtype != want_dtype and not (dtype.is_floating_point and want_dtype.is_floating_point):
            problems.append(
                f"{name!r} is {dtype_name(dtype)}, the model's is {dtype_name(want_dtype)} "
                "(only floating-point weights are cast on the way)"
            )
    _refuse(problems)


def state_dict_specs(state_dict: Mapping[str, torch.Tensor]) -> TensorSpecs:
    """``{name: (shape, dtype)}`` of an in-process state dict.

    Raises:
        WeightUpdateError: a value is not a tensor.
    """
    specs = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(
                f"weight update refused, nothing was written: {name!r} is a "
                f"{type(tensor).__name__}, not a torch.Tensor"
            )
        specs[name] = (tensor.shape, tensor.dtype)
    return specs


def check_update_is_complete(
    incoming: Iterable[str],
    model: TensorSpecs,
    optional: Collection[str] = (),
    groups: Sequence[Collection[str]] = (),
) -> None:
    """Refuse an update that leaves out a weight of the model.

    The rule of every backend: an update carries every weight (each tied weight under one of
    its names), so no layer is ever half old, half new. vLLM reloads whole fused layers, and a
    trainer always holds the whole state dict. Where some of the model's weights form
    ``groups`` refitted on their own (a LoRA adapter), each group and the rest are each carried
    whole or not at all, and an update carries at least one of them.

    Args:
        incoming: the names the update carries.
        model: the model's ``{name: (shape, dtype)}``.
        optional: names an update may omit (e.g. ``lm_head.weight`` tied to the embeddings).
        groups: sets of names sent on their own (e.g. an adapter's tensors).

    Raises:
        WeightUpdateError: naming the missing weights.
    """
    arrived = set(incoming)
    grouped: set[str] = set().union(*groups) if groups else set()
    base = set(model) - grouped - set(optional)
    carried = [part for part in (base, *(set(g) for g in groups)) if part & arrived]
    missing = sorted(set().union(*carried) - arrived if groups and carried else base - arrived)
    if missing:
        listed = ", ".join(missing[:_MAX_LISTED])
        more = len(missing) - _MAX_LISTED
        whole = "the model" + (" (its base, its adapter, or both, each whole)" if groups else "")
        raise WeightUpdateError(
            f"weight update refused, nothing was written: an update must carry every weight of "
            f"{whole}; missing {listed}" + (f" and {more} more" if more > 0 else "")
        )


def _refuse(problems: list[str]) -> None:
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
    """Map the shared buckets and return ``(name, tensor)`` views of every weight, in order,
    every tensor verified first.

    Nothing is copied: each tensor views its bucket (shared memory or CUDA IPC), which stays
    mapped while any view lives. Segments are not unlinked here, because several workers may read
    the same handles; the backend calls ``release_shared_weights`` once all have. A consumer
    that writes each tensor as it comes should use ``iter_shared_weights`` instead, which
    verifies each tensor just before handing it on (its bytes are then read while in cache).

    Args:
        handles: ``SharedWeights.handles``.
        expected: the model's ``{name: (shape, dtype)}``; checked before any bucket is mapped.
        verify: check each tensor's bytes against the checksum the producer recorded.

    Raises:
        WeightUpdateError: malformed handles, a mismatch with ``expected``, a segment that is
            gone or on another host, or bytes that changed since they were shared.
    """
    specs = describe_weight_handles(handles)
    if expected is not None:
        check_weights_match(specs, expected)
    if verify:
        return list(iter_shared_weights(handles))
    out: list[tuple[str, torch.Tensor]] = []
    for bucket in handles["buckets"]:
        out.extend(unpack(_map(handles, bucket), bucket["tensors"]))
    return out


def iter_shared_weights(handles: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of every weight, in order, each verified just before it is
    yielded.

    Raises:
        WeightUpdateError: a segment is gone or on another host, or a tensor's bytes changed
            since they were shared (the tensors yielded before it were intact).
    """
    for bucket in handles["buckets"]:
        yield from unpack_verified(_map(handles, bucket), bucket["tensors"])


def write_shared_weights(
    handles: Mapping[str, Any],
    targets: Mapping[str, torch.Tensor],
    committed: CommittedWeights | None = None,
) -> int:
    """Copy every weight of ``handles`` into ``targets[name]`` in place, verifying each byte just
    before it is written: a host tensor of the same dtype is verified and copied chunk by chunk,
    on a few threads (``chunked.verified_copy``), so its bytes are read from memory once; any
    other (a cast, a GPU model) is verified whole, then copied.

    With ``committed`` (views of ``targets``), a delta is applied through it (its base checked
    before anything is written, the tensor it makes checked against the trainer's checksum) and
    every whole tensor is recorded there; without, a delta is refused.

    The caller has checked names, shapes and dtypes (``check_weights_match``) and holds off
    every reader of ``targets`` meanwhile.

    Returns:
        The number of tensors written.

    Raises:
        WeightUpdateError: a segment is gone or on another host, bytes changed since they
            were shared, or a delta was refused (``WeightBaseError`` for its base); the tensors
            (and, within a tensor, the chunks) before it were written, each verified.
    """
    written = 0
    with torch.no_grad():
        for bucket in handles["buckets"]:
            data = _map(handles, bucket)
            for slot in bucket["tensors"]:
                name = slot["name"]
                target = targets[name]
                if "delta" in slot:
                    for _, delta in unpack_entries(data, [slot]):
                        if committed is None or not isinstance(delta, TensorDelta):
                            raise WeightUpdateError(
                                f"weight {name!r} arrived as a delta, and this receiver keeps "
                                "no base to apply it to: send whole tensors"
                            )
                        committed.apply(name, delta)
                elif _copies_bytewise(target, slot):
                    source = data[slot["offset"] : slot["offset"] + slot["nbytes"]]
                    flat = target.detach().view(-1).view(torch.uint8)
                    verified_copy(flat, source, slot["chunks"], name)
                    if committed is not None:
                        committed.write(name, target, slot["checksum"])
                else:
                    for _, tensor in unpack_verified(data, [slot]):
                        target.copy_(tensor)
                    if committed is not None:
                        committed.write(name, target)
                written += 1
    return written


def delta_bases(slots: Iterable[Mapping[str, Any]]) -> set[int]:
    """The base versions the deltas among ``slots`` name (empty: no delta)."""
    return {int(slot["delta"]["base_version"]) for slot in slots if "delta" in slot}


def _copies_bytewise(target: torch.Tensor, slot: Mapping[str, Any]) -> bool:
    """Whether ``slot``'s bytes can be copied into ``target`` as they are, chunk by chunk."""
    return (
        "chunks" in slot
        and target.device.type == "cpu"
        and target.is_contiguous()
        and target.dtype == dtype_from_name(slot["dtype"])
        and target.numel() * target.element_size() == slot["nbytes"]
    )


def _map(handles: Mapping[str, Any], bucket: Mapping[str, Any]) -> torch.Tensor:
    return map_bucket(handles, bucket, cache=not handles.get("release_after_read", True))


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
    merged = WeightHandles(
        format=HANDLES_FORMAT,
        host=hosts.pop(),
        buckets=buckets,
        release_after_read=all(part.get("release_after_read", True) for part in parts),
    )
    describe_weight_handles(merged)
    return merged


def handles_checksum(handles: Mapping[str, Any]) -> int:
    """One checksum of everything the handles carry, from the checksums their producer recorded
    (``read_shared_weights`` verifies the bytes against those): what a worker "received"."""
    return combine_checksums(b["checksum"] for b in handles["buckets"])


def release_shared_weights(handles: Mapping[str, Any]) -> int:
    """Unlink the shared-memory segments of ``handles`` (views already mapped stay valid).

    Idempotent. Does nothing for handles whose producer reuses its buckets
    (``release_after_read`` false: a streaming refit's ring) or for CUDA buckets, which their
    producer frees. Returns the number of segments removed.
    """
    if not handles.get("release_after_read", True):
        return 0
    removed = 0
    for bucket in handles.get("buckets", []):
        if bucket.get("transport") == "shm" and bucket.get("location"):
            removed += unlink_segment(bucket["location"])
    return removed


def map_bucket(
    handles: Mapping[str, Any], bucket: Mapping[str, Any], *, cache: bool = False
) -> torch.Tensor:
    """The bucket's bytes as a uint8 tensor, mapped (shared memory) or opened (CUDA IPC).

    Args:
        cache: keep the shared-memory mapping for the next load of the same segment (a
            streaming refit reuses its segments; mapping anew would fault in every page again).

    Raises:
        WeightUpdateError: the segment is gone or on another host, or CUDA is unavailable.
    """
    if bucket["transport"] == "shm":
        here = socket.gethostname()
        if handles["host"] != here:
            raise WeightUpdateError(
                f"weights were shared in memory on host {handles['host']!r}, but this worker "
                f"runs on {here!r}: shared memory only reaches processes on the same machine"
            )
        return map_segment(bucket["location"], bucket["nbytes"], cache=cache)
    if bucket["transport"] == "cuda_ipc":
        return import_cuda_bucket(bucket["ipc_args"], bucket["device_uuid"])
    raise WeightUpdateError(f"unknown weight bucket transport {bucket['transport']!r}")
