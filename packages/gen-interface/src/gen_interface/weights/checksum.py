"""A fast, order-sensitive checksum of tensor bytes, to prove a worker loaded what was sent.

Not cryptographic: it detects stale, partial or misplaced weights, at memory bandwidth.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["bytes_checksum", "weights_checksum"]

_CHUNK_WORDS = 1 << 22
_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1


def bytes_checksum(data: torch.Tensor) -> int:
    """Checksum of a tensor's bytes (any dtype, any device, contiguous or not).

    The bytes are read as little-endian 64-bit words (zero-padded); the result combines their
    wrapping sum with a position-weighted sum, so reordered words change it.
    """
    raw = data.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % 8
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    words = raw.view(torch.int64)
    total = 0
    weighted = 0
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start : start + _CHUNK_WORDS]
        positions = torch.arange(start + 1, start + 1 + chunk.numel(), device=chunk.device)
        total += int(chunk.sum())
        weighted += int((chunk * positions).sum())
    return (total * 0x9E3779B1 + weighted + words.numel()) & _MASK63


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Checksum of named tensors, independent of iteration order, sensitive to names and bytes."""
    combined = 0
    for name, tensor in named_tensors:
        name_words = torch.frombuffer(bytearray(name.encode()), dtype=torch.uint8)
        combined += _mix(bytes_checksum(name_words) ^ (bytes_checksum(tensor) * 0x9E3779B97F4A7C15))
    return combined & _MASK63


def _mix(x: int) -> int:
    """splitmix64's finaliser: pairs each name with its bytes inseparably."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
