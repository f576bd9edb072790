"""The receiving end of the collective path: one broadcast bucket into a worker's memory.

The trainer's end (``gen_interface.weights.WeightBroadcaster``) packs and broadcasts a bucket;
a backend's worker that joined the same group (``join_weight_group``) receives it here and
verifies every tensor against the checksum the trainer took before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from gen_interface.weights.collective import BroadcastBucket, WeightGroup, broadcast
from gen_interface.weights.handles import TensorSlot
from gen_interface.weights.layout import Entry, unpack_entries, unpack_verified

__all__ = ["receive_broadcast", "receive_broadcast_entries"]


def receive_broadcast(
    group: WeightGroup, bucket: BroadcastBucket
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive one broadcast bucket into new memory on the group's device.

    Returns:
        ``(name, tensor)`` views of the received bytes (nothing else holds them), each verified
        just before it is yielded.

    Raises:
        WeightUpdateError (while iterating): a tensor differs from what the trainer sent.
    """
    data = torch.empty(max(bucket["nbytes"], 1), dtype=torch.uint8, device=group.device)
    broadcast(group, data)
    return unpack_verified(data, bucket["tensors"])


def receive_broadcast_entries(
    group: WeightGroup, bucket: BroadcastBucket
) -> Iterator[tuple[TensorSlot, Entry]]:
    """``receive_broadcast`` for a worker that keeps a base: ``(slot, tensor or delta)`` of
    every slot, each verified (a delta's encoded bytes) just before it is yielded.

    Raises:
        WeightUpdateError (while iterating): bytes differ from what the trainer sent, or a
            delta is malformed.
    """
    data = torch.empty(max(bucket["nbytes"], 1), dtype=torch.uint8, device=group.device)
    broadcast(group, data)
    return unpack_entries(data, bucket["tensors"])
