"""Receiving one load of a weight update in a worker, whatever carried it.

A load is shared buckets (``handles``: shared memory or CUDA IPC) or one broadcast bucket
(``broadcast``, over the weight group). Either way each bucket is verified against the checksum
its producer recorded before any of it is handed on, one bucket at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
from gen_backend_kit.weights import handles_for_device, receive_broadcast_entries
from gen_backend_kit.weights.consumer import map_bucket
from gen_interface import WeightUpdateError
from gen_interface.weights.collective import BroadcastBucket, WeightGroup
from gen_interface.weights.delta import TensorDelta
from gen_interface.weights.handles import TensorSlot, WeightHandles
from gen_interface.weights.layout import Entry, unpack_entries

__all__ = ["LoadInfo", "ReceivedBucket", "receive_load", "whole_tensors"]


class LoadInfo(TypedDict, total=False):
    """One load, as the driver sends it to every rank: exactly one of the two keys."""

    handles: WeightHandles
    broadcast: BroadcastBucket


@dataclass(frozen=True)
class ReceivedBucket:
    """One verified bucket: its entries (tensors, or deltas, viewing the received bytes) and its
    checksum."""

    entries: Iterator[tuple[TensorSlot, Entry]]  # each verified just before it is yielded
    checksum: int
    # The producer's bucket the tensors view, when it is shared memory the producer reuses:
    # anything that must outlive the load has to be copied out of it. None otherwise.
    shared: torch.Tensor | None
    names: tuple[str, ...] = ()  # the tensors' names, in order (known before reading them)


def receive_load(
    info: Mapping[str, Any], *, device_uuid: str | None, group: WeightGroup | None
) -> Iterator[ReceivedBucket]:
    """The buckets of one load, in order; each tensor is verified just before it is yielded.

    Args:
        info: a ``LoadInfo``.
        device_uuid: this rank's GPU, or None on CPU (which copy of shared handles it reads).
        group: the weight group, for broadcast loads.

    Raises:
        WeightUpdateError: a bucket is gone, damaged, or on another host; a broadcast load
            without a group; or info that is neither.
    """
    if "handles" in info:
        handles = handles_for_device(info["handles"], device_uuid)
        reusable = not handles.get("release_after_read", True)
        for bucket in handles["buckets"]:
            data = map_bucket(handles, bucket, cache=reusable)
            yield ReceivedBucket(
                unpack_entries(data, bucket["tensors"]),
                bucket["checksum"],
                data if reusable else None,
                tuple(slot["name"] for slot in bucket["tensors"]),
            )
    elif "broadcast" in info:
        if group is None:
            raise WeightUpdateError(
                "a broadcast weight load arrived before this worker joined a weight group: "
                "call init_collective (WeightBroadcaster.connect) first"
            )
        bucket = info["broadcast"]
        names = tuple(slot["name"] for slot in bucket["tensors"])
        entries = receive_broadcast_entries(group, bucket)
        yield ReceivedBucket(entries, bucket["checksum"], None, names)
    else:
        raise WeightUpdateError(
            f"a weight load names neither handles nor a broadcast: {sorted(info)}"
        )


def whole_tensors(
    entries: Iterator[tuple[TensorSlot, Entry]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a bucket for a worker that keeps no base: a delta is refused.

    Raises:
        WeightUpdateError (while iterating): a delta arrived.
    """
    for slot, entry in entries:
        if isinstance(entry, TensorDelta):
            raise WeightUpdateError(
                f"weight {slot['name']!r} arrived as a delta, and this worker keeps no base to "
                "apply it to (vllm_cfg.weight_deltas is off): send whole tensors"
            )
        yield slot["name"], entry
