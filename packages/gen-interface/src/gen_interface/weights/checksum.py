"""Checksums of tensor bytes at memory speed, to prove a worker loaded what was sent.

Not cryptographic: they detect stale, partial, torn or misplaced weights. One pass over the
bytes: for host memory, xxHash's XXH3 (64-bit) of every 1 MiB chunk (``chunked.py``, on a few
threads), combined; for CUDA memory, a reduction on the device (the bytes never cross to the
host).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gen_interface.weights.chunked import chunk_checksums

__all__ = ["bytes_checksum", "combine_checksums", "named_checksums", "weights_checksum"]

_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1
# Words per lane group of the CUDA reduction: word i adds into lane i % _LANES.
_LANES = 64


def bytes_checksum(data: torch.Tensor) -> int:
    """Checksum of a tensor's bytes (any dtype, shape or device), in one pass.

    Host tensors: the XXH3-64 of every ``CHUNK_BYTES`` chunk, in memory order, combined by
    ``combine_checksums`` (a copy that hashes chunk by chunk gets it for free). CUDA tensors:
    the bytes as 64-bit words summed into 64 lanes by position (word i into lane i % 64) on
    the device, the lanes weighted by distinct odd multipliers; sensitive to changed bytes and
    to words moved to another lane. The two kinds differ: compare checksums of the same device type.
    """
    raw = data.detach()
    if not raw.is_contiguous():
        raw = raw.contiguous()
    raw = raw.reshape(-1).view(torch.uint8)
    if raw.device.type == "cuda":
        return _device_checksum(raw)
    if raw.device.type != "cpu":
        raw = raw.cpu()
    return combine_checksums(chunk_checksums(raw))


def combine_checksums(checksums: Iterable[int]) -> int:
    """One checksum of an ordered sequence of checksums (e.g. a transaction's buckets)."""
    combined = 0
    for index, value in enumerate(checksums):
        combined = _mix(combined ^ _mix(value + index * 0x9E3779B97F4A7C15))
    return combined & _MASK63


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Checksum of named tensors, independent of iteration order, sensitive to names and bytes."""
    return named_checksums((name, bytes_checksum(tensor)) for name, tensor in named_tensors)


def named_checksums(checksums: Iterable[tuple[str, int]]) -> int:
    """One checksum of ``(name, bytes_checksum)`` pairs, independent of their order:
    ``weights_checksum`` of tensors whose checksums are already known."""
    import xxhash

    combined = 0
    for name, checksum in checksums:
        name_hash = xxhash.xxh3_64_intdigest(name.encode())
        combined += _mix(name_hash ^ (checksum * 0x9E3779B97F4A7C15))
    return combined & _MASK63


def _device_checksum(raw: torch.Tensor) -> int:
    pad = (-raw.numel()) % (8 * _LANES)
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    lanes = raw.view(torch.int64).view(-1, _LANES).sum(dim=0).tolist()  # wraps modulo 2^64
    total = raw.numel()
    for lane, value in enumerate(lanes):
        total = _mix(total ^ ((value & _MASK64) * (2 * lane + 0x9E3779B1)))
    return total & _MASK63


def _mix(x: int) -> int:
    """splitmix64's finaliser."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
