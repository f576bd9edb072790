"""Relaying shared weights to another machine: buckets read where they were shared, written
again into shared memory where they are read.

Shared memory reaches only the processes of its own machine. A reader on another node (a
fleet's replacement started elsewhere after its node was lost) takes each bucket's bytes through
whatever carries data between the nodes (Ray's object store, for gen-vllm), one bucket at a time,
and writes them into a segment of its own machine. The handles it gets back name those segments
and keep every checksum the producer recorded, so the load that reads them verifies each tensor
exactly as it would the producer's own buckets: nothing on the way is trusted.

Memory: the reader's machine holds one copy of the weights in its segments until the load
that reads them releases them (``release_shared_weights``), plus one bucket in transit; the
producer's machine holds one bucket's bytes besides its own shared buckets.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from gen_interface.errors import WeightUpdateError
from gen_interface.weights.handles import HANDLES_FORMAT, WeightBucket, WeightHandles
from gen_interface.weights.shm import create_segment, unlink_segment

from gen_backend_kit.weights.consumer import map_bucket

__all__ = ["bucket_bytes", "rehosted_bucket", "rehosted_handles"]


def bucket_bytes(handles: Mapping[str, Any], index: int) -> np.ndarray:
    """Run where ``handles`` were shared: bucket ``index``'s bytes (uint8 ``[nbytes]``), a view
    of its segment, mapped, not copied: whatever carries them copies them once (Ray's return
    puts them in its object store), and the mapping outlives a release of the segment.

    Raises:
        WeightUpdateError: ``index`` is not a bucket of ``handles``; the bucket is not in
            shared memory, or its segment is gone or on another host.
    """
    buckets = handles["buckets"]
    if not 0 <= index < len(buckets):
        raise WeightUpdateError(f"bucket {index} asked of weight handles with {len(buckets)}")
    bucket = buckets[index]
    if bucket["transport"] != "shm":
        raise WeightUpdateError(
            f"only shared-memory buckets are relayed between machines, bucket {index} is "
            f"{bucket['transport']!r}"
        )
    return map_bucket(handles, bucket).numpy()


def rehosted_bucket(bucket: Mapping[str, Any], data: np.ndarray) -> WeightBucket:
    """Write a relayed bucket's bytes into a new segment on this machine: the bucket as it is
    here (same tensors, same checksums, this segment's path). The bytes are not checked here;
    the load that reads the bucket verifies each tensor against the producer's checksums.

    Raises:
        WeightUpdateError: ``data`` is not the bucket's size, or this machine's shared memory
            has no room (nothing is left behind).
    """
    flat = np.asarray(data, dtype=np.uint8).reshape(-1)
    if flat.size != bucket["nbytes"]:
        raise WeightUpdateError(
            f"a relayed weight bucket arrived with {flat.size} bytes, its handles say "
            f"{bucket['nbytes']}: the relay lost or added bytes"
        )
    path, view = create_segment(int(bucket["nbytes"]))
    try:
        view.numpy()[:] = flat
    except BaseException:
        unlink_segment(path)
        raise
    return WeightBucket(**{**bucket, "location": path})  # type: ignore[typeddict-item]


def rehosted_handles(buckets: Sequence[WeightBucket]) -> WeightHandles:
    """Handles naming relayed ``buckets`` on this machine; the reader releases them once read
    (``release_shared_weights``), as it would the producer's."""
    return WeightHandles(
        format=HANDLES_FORMAT,
        host=socket.gethostname(),
        buckets=list(buckets),
        release_after_read=True,
    )
