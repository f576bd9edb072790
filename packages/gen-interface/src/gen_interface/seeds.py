"""Per-row sampling seeds: how one call's seed becomes a seed for each of its rows.

A row's seed depends only on the call's seed and the row's index (or on the caller's own
``sample_seeds`` entry for it), never on its batch mates, the batch size or which worker runs
it. That is what lets a client spread one call's rows over several calls, replicas or servers
and still draw, for each row, exactly what the one call would have drawn.
"""

from __future__ import annotations

import secrets

__all__ = ["MAX_SEED", "derive_row_seeds", "derive_sample_seeds", "row_seed"]

_MASK64 = (1 << 64) - 1
_INT63 = (1 << 63) - 1

#: Seeds are unsigned 64-bit integers: what ``torch.Generator.manual_seed`` and vLLM's per-request
#: ``SamplingParams.seed`` accept. Config seeds must lie in ``[0, MAX_SEED]``.
MAX_SEED = _MASK64


def row_seed(sample_seed: int) -> int:
    """The seed a row samples with when its ``sample_seeds`` entry is ``sample_seed``.

    splitmix64, a bijection of 64-bit integers, so every bit of the caller's seed matters even
    to generators that keep only 32 bits of their seed (torch's CPU generator and vLLM's sampler
    do): seeds 2^32 apart give unrelated samples, not the same one.
    """
    x = (int(sample_seed) + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_row_seeds(base_seed: int | None, count: int) -> list[int]:
    """Per-row sampling seeds for rows ``0..count-1`` of one call.

    Row i's seed depends only on ``base_seed`` and ``i``. ``base_seed=None`` draws a fresh
    base, so calls differ. Every bit of ``base_seed`` (any value in ``[0, MAX_SEED]``) reaches
    the low 32 bits of the row seeds, the part torch's CPU generator keeps. They are the seeds
    rows get whose ``sample_seeds`` are ``derive_sample_seeds(base_seed, count)``.
    """
    return [row_seed(s) for s in derive_sample_seeds(base_seed, count)]


def derive_sample_seeds(base_seed: int | None, count: int) -> list[int]:
    """The ``sample_seeds`` entries (each in ``[0, 2**63)``, the range the input takes) that give
    rows ``0..count-1`` exactly the seeds ``derive_row_seeds`` derives from ``base_seed``: what
    a client sends when it spreads one call's rows over several calls (one request per row, one
    call per replica) and wants each row to draw what it draws in the one call."""
    base = secrets.randbits(64) if base_seed is None else base_seed
    return [row_seed((base * 0x9E3779B97F4A7C15 + i) & _MASK64) & _INT63 for i in range(count)]
