"""The sampling distribution every backend samples from, and the reference decoding step.

``processed_log_probs`` is the one definition of the "processed" distribution in CONTRACT.md:
temperature, then min-p, then top-k, then top-p over the renormalised distribution, the order
vLLM uses.
Backends that sample themselves call it; parity checks compare backends against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from gen_backend_kit.row_sampling import RowSampling

__all__ = [
    "TokenChoice",
    "processed_log_probs",
    "report_tokens",
    "row_generators",
    "select_next_tokens",
]


def processed_log_probs(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_k: int | Sequence[int | None] | None = None,
    top_p: float | torch.Tensor = 1.0,
    min_p: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """Log-probabilities of the distribution actually sampled from.

    Args:
        logits: ``[N, V]`` raw logits (any float dtype; computed in float32).
        temperature: > 0, a scalar or ``[N]``.
        top_k: None (off), an int >= 1, or one of those per row.
        top_p: in (0, 1], a scalar or ``[N]``; 1.0 is off.
        min_p: in [0, 1], a scalar or ``[N]``; 0.0 is off.

    Returns:
        float32 ``[N, V]``: ``log_softmax`` of the tempered logits restricted to the tokens that
        survive min-p (probability at least ``min_p`` times the likeliest's), then top-k (ties
        with the k-th value survive), then top-p (the smallest set of highest-probability tokens
        whose renormalised mass reaches ``top_p``; at least one). Filtered tokens hold ``-inf``.
    """
    scaled = logits.float() / torch.as_tensor(temperature, dtype=torch.float32).reshape(-1, 1)
    n, vocab = scaled.shape
    floor = torch.as_tensor(min_p, dtype=torch.float32).reshape(-1, 1).expand(n, 1)
    if bool((floor > 0).any()):
        probs = scaled.softmax(dim=-1)
        scaled = scaled.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * floor, float("-inf"))
    ks = _per_row_top_k(top_k, n)
    p = torch.as_tensor(top_p, dtype=torch.float32).reshape(-1, 1).expand(n, 1)
    if all(k is None for k in ks) and not bool((p < 1).any()):
        # Neither top-k nor top-p: the sort below and its inverse scatter would give back
        # ``scaled`` bit for bit, at the price of sorting every row's vocabulary.
        return scaled.log_softmax(dim=-1)
    sorted_logits, order = scaled.sort(dim=-1, descending=False)
    if any(k is not None for k in ks):
        k_tensor = torch.tensor([vocab if k is None else min(k, vocab) for k in ks])
        kth = sorted_logits.gather(1, (vocab - k_tensor).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if bool((p < 1).any()):
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - p
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits)
    return filtered.log_softmax(dim=-1)


def row_generators(seeds: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per row, seeded with that row's seed."""
    return [torch.Generator().manual_seed(int(seed)) for seed in seeds]


class TokenChoice(NamedTuple):
    """One decoding step's choice for A rows.

    Attributes:
        tokens: int64 ``[A]``.
        logprobs: float32 ``[A]``, in the logprobs mode (raw for greedy rows).
        topk_ids: int64 ``[A, K]`` (``K``: the most ``top_logprobs`` of the A rows): each
            row's ``top_logprobs`` likeliest tokens, most likely first; -1 past the row's own k.
        topk_logprobs: float32 ``[A, K]``: their logprobs in the same distribution as
            ``logprobs``; 0.0 past the row's own k.
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor


def select_next_tokens(
    logits: torch.Tensor,
    rows: Sequence[RowSampling],
    *,
    processed: bool,
    generators: Sequence[torch.Generator],
) -> TokenChoice:
    """Pick each row's next token and its log-probability: the reference decoding step.

    Args:
        logits: ``[A, V]`` next-token logits of the A rows still running.
        rows: each row's sampling (``RowSampling``). Greedy rows take the argmax (first index
            on exact ties) and report raw logprobs; the others sample from
            ``processed_log_probs`` with their own temperature, min-p, top-k and top-p.
        processed: sampled rows report processed rather than raw log-probabilities (their top
            logprobs too).
        generators: one per row; row i draws only from ``generators[i]``, so its sample does
            not depend on the other rows.

    Returns:
        A ``TokenChoice``, on the CPU when some row sampled or asked for top logprobs.
    """
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.greedy]
    if sampled:
        index = torch.tensor(sampled, dtype=torch.int64)
        filtered = _processed_rows(logits, rows, sampled)
        draws = _draw(filtered, [generators[i] for i in sampled])
        tokens = tokens.cpu().index_copy(0, index, draws)
        return report_tokens(logits, tokens, rows, processed=processed, filtered=filtered)
    return report_tokens(logits, tokens, rows, processed=processed)


def _draw(log_probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row, int64 ``[A]``, from ``log_probs`` ``[A, V]``; row j draws only from
    ``generators[j]``.

    Exactly ``torch.multinomial(log_probs[j].exp(), 1, generator=generators[j])`` for every row
    (the same tokens, the generators left in the same states): for one sample, torch draws ``V``
    exponential variates from the generator and takes the argmax of the probabilities divided
    by them. Here only those draws are made row by row; the division and the argmax run once for
    the whole batch. A row whose probabilities are not finite raises as ``multinomial`` does.
    """
    probs = log_probs.exp()
    if not bool(torch.isfinite(probs).all()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    noise = torch.empty_like(probs)
    for row, generator in zip(noise, generators, strict=True):
        row.exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def report_tokens(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    rows: Sequence[RowSampling],
    *,
    processed: bool,
    filtered: torch.Tensor | None = None,
) -> TokenChoice:
    """The ``TokenChoice`` reporting ``tokens`` ``[A]`` as chosen from ``logits`` ``[A, V]``:
    their logprobs and top logprobs in the distribution ``select_next_tokens`` reports (raw for
    greedy rows; processed for sampled rows when ``processed``). A speculative step reports the
    tokens it accepted with the target's logits here, so they read as plain decoding's would.

    Args:
        filtered: the sampled rows' ``processed_log_probs`` (in the order of the sampled rows),
            when the caller has them; computed otherwise.
    """
    raw = logits.float().log_softmax(dim=-1)
    most = max((row.top_logprobs for row in rows), default=0)
    sampled = [i for i, row in enumerate(rows) if not row.greedy]
    reported = raw
    if sampled and processed:
        index = torch.tensor(sampled, dtype=torch.int64)
        if filtered is None:
            filtered = _processed_rows(logits, rows, sampled)
        reported = raw.cpu().index_copy(0, index, filtered)
    if sampled or most:
        reported, tokens = reported.cpu(), tokens.cpu()
    chosen = reported.gather(1, tokens.to(reported.device)[:, None]).squeeze(1)
    return TokenChoice(tokens, chosen, *_top_logprobs(reported, rows, most))


def _processed_rows(
    logits: torch.Tensor, rows: Sequence[RowSampling], which: Sequence[int]
) -> torch.Tensor:
    """``processed_log_probs`` ``[len(which), V]`` of rows ``which``, on the CPU (where each
    row's generator lives), each with its own temperature, top-k, top-p and min-p."""
    index = torch.tensor(list(which), dtype=torch.int64)
    subset = [rows[i] for i in which]
    return processed_log_probs(
        logits.index_select(0, index.to(logits.device)).cpu(),
        torch.tensor([row.temperature for row in subset]),
        [row.top_k for row in subset],
        torch.tensor([row.top_p for row in subset]),
        torch.tensor([row.min_p for row in subset]),
    )


def _top_logprobs(
    distribution: torch.Tensor, rows: Sequence[RowSampling], most: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``top_logprobs`` best entries of ``distribution`` ``[A, V]``, padded to
    ``most``: ids -1 and logprobs 0.0 past a row's own k."""
    count = len(rows)
    if most == 0:
        return torch.zeros((count, 0), dtype=torch.int64), torch.zeros((count, 0))
    values, ids = distribution.cpu().topk(min(most, distribution.shape[-1]), dim=-1)
    past = (
        torch.arange(values.shape[-1])[None, :]
        >= torch.tensor([row.top_logprobs for row in rows])[:, None]
    )
    return ids.masked_fill(past, -1), values.masked_fill(past, 0.0)


def _per_row_top_k(top_k: int | Sequence[int | None] | None, n: int) -> list[int | None]:
    if top_k is None or isinstance(top_k, int):
        return [None if top_k in (None, -1) else top_k] * n
    return [None if k in (None, -1) else k for k in top_k]
