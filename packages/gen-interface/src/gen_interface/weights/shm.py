"""Shared-memory segments as files under ``/dev/shm``, mapped into tensors with no copy.

Plain files are used rather than ``multiprocessing.shared_memory`` so that no resource tracker in
any process unlinks or warns about segments it does not own; the owner unlinks them explicitly,
and its holders (``BucketRing``, ``SharedWeights``) do so when collected or at interpreter exit.

A segment cannot outlive its owner for long even when the owner dies without a word (SIGKILL,
the OOM killer, a preempted node): its name holds the owner's PID namespace, pid and start
time, and ``sweep_orphans`` removes every segment whose owner is no longer running. It runs once
per process, when the process makes its first segment: where segments are made, not when a
backend merely starts. The start time tells a reused pid from the owner; segments made in another
PID namespace (a container sharing ``/dev/shm``) are left alone, since their owners cannot be
seen from here.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import cast

import torch

from gen_interface.errors import WeightUpdateError

__all__ = [
    "create_segment",
    "map_segment",
    "owner_of",
    "owner_tag",
    "segment_dir",
    "sweep_orphans",
    "unlink_segment",
]

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "gen_interface-"

# ``(pid, "<namespace>-<pid>-<start time>")`` of the process that made segments last (after a
# fork the child differs): it swept orphans once, and names its segments with the tag.
_owner: tuple[int, str] | None = None

# Mappings kept by map_segment(cache=True): path -> ((inode, size), mapping), oldest first.
_MAPPINGS: OrderedDict[str, tuple[tuple[int, int], torch.Tensor]] = OrderedDict()
_CACHED_MAPPINGS = 64  # address space only: mappings of removed segments are dropped


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
    global _owner
    pid = os.getpid()
    if _owner is None or _owner[0] != pid:
        _owner = (pid, owner_tag())
        sweep_orphans()
    size = max(nbytes, 1)
    path = str(segment_dir() / f"{SEGMENT_PREFIX}{_owner[1]}-{uuid.uuid4().hex}")
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


def owner_tag() -> str:
    """``"<PID namespace>-<pid>-<start time>"`` of this process: what a segment's name holds
    after its prefix, so that ``sweep_orphans`` can tell when its owner is gone."""
    pid = os.getpid()
    return f"{_pid_namespace()}-{pid}-{_start_time(pid) or 0}"


def owner_of(
    path: str | Path, prefix: str = SEGMENT_PREFIX
) -> tuple[int | None, int, int | None] | None:
    """``(PID namespace, pid, start time)`` of the process that made segment ``path``, from its
    name: ``prefix``, ``owner_tag()``, ``-`` and a unique part without ``-`` (namespace and
    start time None where unknown: names of earlier releases hold the pid alone); None for a
    name not made so."""
    name = Path(path).name
    if not name.startswith(prefix):
        return None
    parts = name[len(prefix) :].split("-")
    try:
        if len(parts) == 4:
            return int(parts[0]), int(parts[1]), int(parts[2]) or None
        if len(parts) == 2:
            return None, int(parts[0]), None
    except ValueError:
        return None
    return None


def sweep_orphans(directory: Path | None = None, prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Remove every segment (file or directory) named ``prefix`` + ``owner_tag()`` + ``-...``
    whose owner is no longer running; returns their paths. A segment whose owner cannot be told
    apart from a live process, or that was made in another PID namespace, is kept. The default
    prefix is this module's; other packages name theirs with their own (gen-sglang's staged
    checkpoints)."""
    removed: list[str] = []
    root = directory if directory is not None else segment_dir()
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    here = _pid_namespace()
    for entry in entries:
        owner = owner_of(entry, prefix)
        if owner is None:
            continue
        namespace, pid, start_time = owner
        if (namespace is not None and namespace != here) or _running(pid, start_time):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
        elif unlink_segment(str(entry)):
            removed.append(str(entry))
    if removed:
        logger.info("removed %d shared-memory segments of processes gone", len(removed))
    return removed


def _pid_namespace() -> int:
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``); 0 where unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _running(pid: int, start_time: int | None) -> bool:
    """Whether process ``pid`` lives (a zombie does not) and, when ``start_time`` is known, is
    the one that started then (not a later process given the same pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, as another user
    seen = _stat(pid)
    if seen is None:
        return True  # no /proc to ask: trust the pid
    state, started = seen
    return state != "Z" and (start_time is None or started == start_time)


def _start_time(pid: int) -> int | None:
    """Process ``pid``'s start time in clock ticks since boot (Linux ``/proc``), else None."""
    seen = _stat(pid)
    return seen[1] if seen is not None else None


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time)`` of process ``pid`` from ``/proc/<pid>/stat``; None without it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields 3 and 22, counted after the command name, which may hold spaces and parentheses.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None
