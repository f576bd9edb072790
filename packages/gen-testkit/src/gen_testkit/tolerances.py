"""How close two generations must be to count as "the same": the one place tolerances live.

Two kinds of comparison, each per dtype:

- ``WITHIN_BACKEND``: one backend against itself under another batch shape (batch mates, padding
  side, shard count). Only floating-point effects of batch shape differ.
- ``ACROSS_BACKENDS``: two backends on the same model and inputs (different kernels).

``logprob_atol`` bounds raw log-probabilities of the same token after the same prefix;
``processed_logprob_atol`` the processed ones (their renormalisation amplifies differences);
``near_tie`` is the top-2 log-probability margin below which two greedy decoders may
legitimately pick different tokens. Every value was measured on this project's tiny models; see
the parity package's README for the runs behind them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ACROSS_BACKENDS", "WITHIN_BACKEND", "Tolerance", "tolerance_for"]


@dataclass(frozen=True)
class Tolerance:
    """Bounds for comparing two generations of the same model and inputs."""

    logprob_atol: float
    processed_logprob_atol: float
    near_tie: float


WITHIN_BACKEND: dict[str, Tolerance] = {
    "float32": Tolerance(logprob_atol=1e-5, processed_logprob_atol=1e-4, near_tie=1e-4),
    "bfloat16": Tolerance(logprob_atol=5e-2, processed_logprob_atol=1e-1, near_tie=1e-1),
    "float16": Tolerance(logprob_atol=1e-2, processed_logprob_atol=2e-2, near_tie=2e-2),
}

ACROSS_BACKENDS: dict[str, Tolerance] = {
    "float32": Tolerance(logprob_atol=1e-5, processed_logprob_atol=1e-4, near_tie=1e-4),
    "bfloat16": Tolerance(logprob_atol=1e-1, processed_logprob_atol=2e-1, near_tie=2e-1),
    "float16": Tolerance(logprob_atol=2e-2, processed_logprob_atol=5e-2, near_tie=5e-2),
}


def tolerance_for(dtype: str, *, across_backends: bool) -> Tolerance:
    """The tolerance for ``dtype`` (``"auto"`` reads as float32, the tiny models' dtype)."""
    table = ACROSS_BACKENDS if across_backends else WITHIN_BACKEND
    key = "float32" if dtype == "auto" else dtype
    try:
        return table[key]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(table)}") from None
