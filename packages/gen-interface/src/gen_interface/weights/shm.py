"""Shared-memory segments as files under ``/dev/shm``, mapped into tensors with no copy.

Plain files are used rather than ``multiprocessing.shared_memory`` so that no resource tracker in
any process unlinks or warns about segments it does not own; the owner unlinks them explicitly.
"""

from __future__ import annotations

import errno
import os
import tempfile
import uuid
from pathlib import Path
from typing import cast

import torch

from gen_interface.errors import WeightUpdateError

__all__ = ["create_segment", "map_segment", "segment_dir", "unlink_segment"]

SEGMENT_PREFIX = "gen_interface-"


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


def map_segment(path: str, nbytes: int) -> torch.Tensor:
    """Map an existing segment as a uint8 tensor ``[nbytes]`` (shared, no copy).

    Raises:
        WeightUpdateError: the segment does not exist or is smaller than ``nbytes``.
    """
    try:
        actual = os.stat(path).st_size
    except FileNotFoundError:
        raise WeightUpdateError(
            f"shared-memory segment {path} does not exist: it was already consumed or released, "
            "or it was shared on another machine"
        ) from None
    if actual < max(nbytes, 1):
        raise WeightUpdateError(f"shared-memory segment {path} holds {actual} bytes, not {nbytes}")
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=max(nbytes, 1))
    return torch.empty(0, dtype=torch.uint8).set_(cast(torch.UntypedStorage, storage))[:nbytes]


def unlink_segment(path: str) -> bool:
    """Remove a segment's name. Mappings that exist stay valid. Returns False if already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
