"""How close two generations must be to count as "the same": the one place tolerances live.

Two kinds of comparison, each per dtype:

- ``WITHIN_BACKEND``: one backend against itself under another batch shape (batch mates, padding
  side, shard count). Only floating-point effects of batch shape differ.
- ``ACROSS_BACKENDS``: two backends on the same model and inputs (different kernels).

``logprob_atol`` bounds raw log-probabilities of the same token after the same prefix;
``processed_logprob_atol`` the processed ones (their renormalisation amplifies differences,
most where the top-p cut-off moves);
``top_k_logprob_atol`` the logprobs of the tokens two backends' top-k lists share (five times
as many values per position as the chosen token's, so a longer tail; default ``logprob_atol``);
``near_tie`` is the top-2 log-probability margin below which two greedy decoders may
legitimately pick different tokens; ``support_slack`` is the fraction of sampled tokens that may
fall outside the exact top-k/top-p support (a reduced-precision backend sees slightly different
logits, so the filters' edges move; float32 allows none). Every value was measured on this
project's tiny models; the testkit's README gives the runs behind them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gen_testkit.routing import ROUTER_NEAR_TIE

__all__ = ["ACROSS_BACKENDS", "WITHIN_BACKEND", "Tolerance", "tolerance_for"]


@dataclass(frozen=True)
class Tolerance:
    """Bounds for comparing two generations of the same model and inputs."""

    logprob_atol: float
    processed_logprob_atol: float
    near_tie: float
    support_slack: float = 0.0
    top_k_logprob_atol: float | None = None
    #: router-logit margin (k-th minus (k+1)-th expert) under which two backends may route a
    #: token to different experts
    router_near_tie: float = ROUTER_NEAR_TIE

    @property
    def top_k_atol(self) -> float:
        """The bound on shared top-k logprobs (``top_k_logprob_atol``, else ``logprob_atol``)."""
        return self.logprob_atol if self.top_k_logprob_atol is None else self.top_k_logprob_atol


# Measured with tools/parity/measure_tolerances.py (40 random batches, 233 rows, about 2,400
# generated tokens per dtype, tiny-qwen2, hf and vllm on CPU); largest values seen:
#   float32   within: 1.19e-5 (hf; vllm bit-exact), no token splits
#             across: teacher-forced 1.05e-5, processed vs exact 1.79e-5, no greedy splits
#   bfloat16  within: 3.23e-2, split gap 3.17e-2
#             across: teacher-forced 0.201, processed 0.487, split gap 0.156, 1.0% off-support;
#             teacher-forced top-5 (measured again with top-k): 0.222 in the measuring run,
#             0.358 in a batch hypothesis found (one-token prompts), lists equal up to edge ties
#   float32 and float16 top-5 values: 1.19e-5 and 2.69e-2, within their logprob bounds
#   float16   within: 8.07e-3, split gap 4.1e-3
#             across: teacher-forced 2.27e-2, processed 0.687, split gap 3.9e-3, 0.1% off-support
# Router near-ties (routed experts, on tiny-qwen3-moe): float32 1e-4 (no split seen, see
# gen_testkit.routing); the reduced-precision ones are the dtype's logit near-tie, not measured
# on an MoE model yet.
# Each bound is the largest value seen, rounded up. In float32 the floor is the model itself: a
# float32 forward pass of these models differs from a float64 one by up to 1.05e-5.

WITHIN_BACKEND: dict[str, Tolerance] = {
    "float32": Tolerance(logprob_atol=2e-5, processed_logprob_atol=5e-5, near_tie=1e-4),
    "bfloat16": Tolerance(
        logprob_atol=5e-2, processed_logprob_atol=1e-1, near_tie=5e-2, router_near_tie=5e-2
    ),
    "float16": Tolerance(
        logprob_atol=1e-2, processed_logprob_atol=2e-2, near_tie=1e-2, router_near_tie=1e-2
    ),
}

ACROSS_BACKENDS: dict[str, Tolerance] = {
    "float32": Tolerance(logprob_atol=2e-5, processed_logprob_atol=5e-5, near_tie=1e-4),
    "bfloat16": Tolerance(
        logprob_atol=2.5e-1,
        processed_logprob_atol=6e-1,
        near_tie=2e-1,
        support_slack=0.05,
        top_k_logprob_atol=4e-1,
        router_near_tie=2e-1,
    ),
    "float16": Tolerance(
        logprob_atol=5e-2,
        processed_logprob_atol=7.5e-1,
        near_tie=1e-2,
        support_slack=0.02,
        router_near_tie=1e-2,
    ),
}


def tolerance_for(dtype: str, *, across_backends: bool) -> Tolerance:
    """The tolerance for ``dtype`` (``"auto"`` reads as float32, the tiny models' dtype)."""
    table = ACROSS_BACKENDS if across_backends else WITHIN_BACKEND
    key = "float32" if dtype == "auto" else dtype
    try:
        return table[key]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(table)}") from None
