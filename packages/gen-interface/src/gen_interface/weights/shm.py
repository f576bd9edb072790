"""Shared-memory segments as files under ``/dev/shm``, mapped into tensors with no copy.

Plain files are used rather than ``multiprocessing.shared_memory`` so that no resource tracker in
any process unlinks or warns about segments it does not own; the owner unlinks them explicitly.
"""

from __future__ import annotations

import errno
import os
import tempfile
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import cast

import torch

from gen_interface.errors import WeightUpdateError

__all__ = ["create_segment", "map_segment", "segment_dir", "unlink_segment"]

SEGMENT_PREFIX = "gen_interface-"

# Mappings kept by map_segment(cache=True): path -> ((inode, size), mapping), oldest first.
_MAPPINGS: OrderedDict[str, tuple[tuple[int, int], torch.Tensor]] = OrderedDict()
_CACHED_MAPPINGS = 8


def segment_dir() -> Path:
    """``/dev/shm`` where it exists (RAM-backed), else the temp directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def create_segment(nbytes: int) -> tuple[str, torch.Tensor]:
    """Create a zero-filled segment of ``nbytes`` and map it.

    Returns:
        ``(path, uint8 tensor [nbytes])``; writes to the tensor land in the segment.

    Raises:
        WeightUpdateError: the shared-memory file system has no room (the message says how much
            was needed and where).
    """
    size = max(nbytes, 1)
    path = str(segment_dir() / f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # Reserve the pages now: writing past a full tmpfs through a mapping kills the process
        # with SIGBUS, while fallocate fails cleanly.
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise WeightUpdateError(
                f"no room for a {size / 2**20:.1f} MiB shared-memory segment in "
                f"{segment_dir()}: free space there or share smaller buckets"
            ) from exc
        raise
    os.close(fd)
    return path, map_segment(path, nbytes)


def map_segment(path: str, nbytes: int, *, cache: bool = False) -> torch.Tensor:
    """Map an existing segment as a uint8 tensor ``[nbytes]`` (shared, no copy).

    Args:
        cache: keep the mapping (the last few) and hand it out again while the segment is the
            same file of the same size: reused segments are then not faulted in anew.

    Raises:
        WeightUpdateError: the segment does not exist or is smaller than ``nbytes``.
    """
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        _MAPPINGS.pop(path, None)
        raise WeightUpdateError(
            f"shared-memory segment {path} does not exist: it was already consumed or released, "
            "or it was shared on another machine"
        ) from None
    if stat.st_size < max(nbytes, 1):
        raise WeightUpdateError(
            f"shared-memory segment {path} holds {stat.st_size} bytes, not {nbytes}"
        )
    identity = (stat.st_ino, stat.st_size)
    cached = _MAPPINGS.get(path)
    if cached is not None and cached[0] == identity:
        _MAPPINGS.move_to_end(path)
        return cached[1][:nbytes]
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=stat.st_size)
    mapped = torch.empty(0, dtype=torch.uint8).set_(cast(torch.UntypedStorage, storage))
    if cache:
        for stale in [p for p in _MAPPINGS if not os.path.exists(p)]:
            del _MAPPINGS[stale]  # its producer removed it: let its memory go
        _MAPPINGS[path] = (identity, mapped)
        while len(_MAPPINGS) > _CACHED_MAPPINGS:
            _MAPPINGS.popitem(last=False)
    return mapped[:nbytes]


def unlink_segment(path: str) -> bool:
    """Remove a segment's name. Mappings that exist stay valid. Returns False if already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
