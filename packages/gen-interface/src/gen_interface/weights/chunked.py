"""Host bytes hashed and copied chunk by chunk, on a few threads: a verified copy at the speed of
a plain one.

A tensor's bytes are cut into ``CHUNK_BYTES`` chunks from its start; each chunk's checksum is its
XXH3-64. A copy hashes each chunk right after writing it (or, when verifying, right before
copying it), while the chunk is still in the core's cache, so the checksums cost no extra pass
over memory. The chunks are split into one contiguous run per thread: NumPy's copy and xxHash
both release the GIL, so a few threads reach the memory bandwidth one thread cannot.

Every function here takes flat, contiguous ``uint8`` CPU tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch
import xxhash

from gen_interface.errors import WeightUpdateError

__all__ = ["CHUNK_BYTES", "chunk_checksums", "copy_with_checksums", "verified_copy"]

#: Bytes per chunk: small enough to stay in a core's L2 cache between the copy and the hash.
CHUNK_BYTES = 1 << 20

_MASK63 = (1 << 63) - 1
#: Threads at most: beyond that a copy is bound by memory, not by cores.
_MAX_THREADS = 8

T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None


def chunk_checksums(data: torch.Tensor) -> list[int]:
    """The checksum of every chunk of ``data``, in order (``[]`` for no bytes)."""
    source = _array(data)
    return _run_chunks(source.size, lambda start, end: _hash(source[start:end]))


def copy_with_checksums(destination: torch.Tensor, source: torch.Tensor) -> list[int]:
    """Copy ``source`` into ``destination`` (same size) and return the checksum of every chunk,
    each taken from the destination right after the chunk was written."""
    into, out_of = _pair(destination, source)

    def copy_then_hash(start: int, end: int) -> int:
        np.copyto(into[start:end], out_of[start:end])
        return _hash(into[start:end])

    return _run_chunks(into.size, copy_then_hash)


def verified_copy(
    destination: torch.Tensor, source: torch.Tensor, expected: Sequence[int], name: str
) -> None:
    """Copy ``source`` into ``destination`` (same size), each chunk checked against its checksum
    in ``expected`` just before it is written: no byte that differs from what the producer wrote
    ever reaches ``destination``.

    Raises:
        WeightUpdateError: a chunk changed since its checksum was taken; chunks of other
            threads may have been written, each of them verified.
    """
    into, out_of = _pair(destination, source)
    if len(expected) != _chunk_count(out_of.size):
        raise WeightUpdateError(
            f"weight {name!r} arrived with {len(expected)} chunk checksums for "
            f"{out_of.size} bytes: the handles are malformed"
        )

    def hash_then_copy(start: int, end: int) -> bool:
        if _hash(out_of[start:end]) != expected[start // CHUNK_BYTES]:
            return False
        np.copyto(into[start:end], out_of[start:end])
        return True

    if not all(_run_chunks(out_of.size, hash_then_copy, stop_on=False)):
        raise WeightUpdateError(
            f"weight {name!r} changed after it was shared or sent (checksum mismatch): the "
            "producer must not write to a bucket until it is loaded"
        )


def _run_chunks(nbytes: int, work: Callable[[int, int], T], stop_on: T | None = None) -> list[T]:
    """``work(start, end)`` for every chunk, in one contiguous run of chunks per thread; the
    results in chunk order. A thread stops its run at a result equal to ``stop_on``."""
    count = _chunk_count(nbytes)
    threads = min(_threads(), count)
    if threads <= 1:
        return _run(0, count, nbytes, work, stop_on)
    bounds = [count * i // threads for i in range(threads + 1)]
    futures: list[Future[list[T]]] = [
        _executor().submit(_run, bounds[i], bounds[i + 1], nbytes, work, stop_on)
        for i in range(1, threads)
    ]
    results = _run(bounds[0], bounds[1], nbytes, work, stop_on)
    for future in futures:
        results.extend(future.result())
    return results


def _run(
    first: int, last: int, nbytes: int, work: Callable[[int, int], T], stop_on: T | None
) -> list[T]:
    results = []
    for index in range(first, last):
        start = index * CHUNK_BYTES
        results.append(result := work(start, min(start + CHUNK_BYTES, nbytes)))
        if stop_on is not None and result == stop_on:
            break
    return results


def _chunk_count(nbytes: int) -> int:
    return (nbytes + CHUNK_BYTES - 1) // CHUNK_BYTES


def _hash(chunk: np.ndarray) -> int:
    return int(xxhash.xxh3_64_intdigest(chunk.data)) & _MASK63


def _array(data: torch.Tensor) -> np.ndarray:
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ValueError("chunked copies take flat, contiguous uint8 tensors")
    if data.device.type != "cpu":
        raise ValueError(f"chunked copies take host tensors, not {data.device}")
    return data.numpy()


def _pair(destination: torch.Tensor, source: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    into, out_of = _array(destination), _array(source)
    if into.size != out_of.size:
        raise ValueError(f"cannot copy {out_of.size} bytes into {into.size}")
    return into, out_of


def _threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, _MAX_THREADS))


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_MAX_THREADS - 1, thread_name_prefix="gen-chunks")
    return _pool


def _forget_pool() -> None:
    """A forked child has none of its parent's threads: it starts a pool of its own."""
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)
