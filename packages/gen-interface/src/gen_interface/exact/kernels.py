"""Batch-invariant kernels: a row's result depends on the row alone, never on its batch mates.

A CPU matrix multiply picks its algorithm (and so its order of additions) from the shapes it is
given: a row multiplied alone, or with a few others, is summed in another order than the same
row among many (measured on MKL: row results agree for every ``M >= 12`` rows, at every inner
size, and differ below). And attention reduces over keys in another order in prefill than in
decode, and over padding in another layout for left than for right padding. These kernels pin
both:

- ``invariant_linear``: every matrix multiply sees at least ``MIN_ROWS`` rows (zero rows are
  added to shorter inputs), and the bias is added after the product.
- ``invariant_attention``: each row's keys are gathered in logical order (padding removed) into
  slots, so key ``j`` of a sequence sits in slot ``j`` whatever the padding; scores are one
  matrix multiply over the head dimension with at least ``MIN_ROWS`` query rows and
  ``SLOT_BLOCK`` slots; the softmax is in float32; values are summed per block of
  ``SLOT_BLOCK`` slots (one fixed-shape multiply each) and the blocks added in order, so slots
  beyond a query's last key only ever add exact zeros.

The same call therefore gives the same bits for a row in a batch of 1 or 64, padded left or
right, decoded one token at a time from a cache or read in one forward pass. Whether this
machine's kernels keep the promise is checked, not assumed: see ``check.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["MIN_ROWS", "SLOT_BLOCK", "invariant_attention", "invariant_linear"]

#: Fewest rows any matrix multiply here sees (shorter inputs are padded with zero rows).
MIN_ROWS = 16
#: Keys are reduced in blocks of this many slots, added one block after another.
SLOT_BLOCK = 64


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose every output row depends on its input row alone.

    Args:
        x: ``[..., K]``.
        weight: ``[N, K]``.
        bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in ``x``'s dtype.
    """
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count < MIN_ROWS:
        rows = torch.cat([rows, rows.new_zeros(MIN_ROWS - count, rows.shape[1])])
    out = F.linear(rows.contiguous(), weight)[:count]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def invariant_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attends: torch.Tensor | None,
    *,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention whose result for a query depends only on the keys it attends to.

    Keys are taken in their order along the key axis (a cache's or a sequence's order); keys no
    query of a row attends to (padding) are dropped before the reduction.

    Args:
        query: ``[B, H, Q, D]``.
        key, value: ``[B, Hkv, T, D]``, ``H`` a multiple of ``Hkv`` (grouped-query attention).
        attends: bool ``[B, 1, Q, T]`` (True where query q may attend to key t), or None for
            causal attention of the last ``Q`` positions over all ``T``.
        scaling: factor on the scores (usually ``D ** -0.5``).
        softcap: if set, scores become ``softcap * tanh(scores / softcap)``.

    Returns:
        ``[B, Q, H, D]`` in ``query``'s dtype (transformers' layout for attention outputs); a
        query that attends to no key gets zeros.
    """
    batch, heads, queries, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    if attends is None:
        attends = (
            torch.ones(queries, length, dtype=torch.bool, device=query.device)
            .tril(length - queries)[None, None]
            .expand(batch, 1, queries, length)
        )
    attends = attends.expand(batch, 1, queries, length)

    # Slots: each row's keys in order, padding (keys no query attends to) removed.
    real = attends[:, 0].any(dim=1)  # [B, T]
    order = torch.argsort((~real).to(torch.int8), dim=-1, stable=True)  # real keys first
    counts = real.sum(dim=-1)  # [B]
    slots = -(-max(int(counts.max()), 1) // SLOT_BLOCK) * SLOT_BLOCK
    taken = min(slots, length)
    order = order[:, :taken]
    in_use = torch.arange(taken, device=query.device)[None] < counts[:, None]  # [B, S']
    keys = _gather_slots(key, order, in_use, slots)  # [B, Hkv, S, D] float32
    values = _gather_slots(value, order, in_use, slots)
    allowed = attends[:, 0].gather(-1, order[:, None, :].expand(batch, queries, taken))
    allowed = F.pad(allowed & in_use[:, None, :], (0, slots - taken))  # [B, Q, S]

    # Queries of one kv head together: [B * Hkv, G * Q, D], at least MIN_ROWS rows.
    rows = group * queries
    q = query.float().reshape(batch * kv_heads, rows, dim)
    padded_rows = max(rows, MIN_ROWS)
    q = F.pad(q, (0, 0, 0, padded_rows - rows))
    scores = torch.bmm(q, keys.reshape(batch * kv_heads, slots, dim).transpose(1, 2))
    scores = scores[:, :rows].reshape(batch, kv_heads, group, queries, slots) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = allowed[:, None, None]  # [B, 1, 1, Q, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
    weights = torch.exp(scores - top).masked_fill(~mask, 0.0)  # [B, Hkv, G, Q, S]

    # Values and the softmax denominator (a column of ones) summed block by block, in order.
    blocks = slots // SLOT_BLOCK
    ones = values.new_ones(batch, kv_heads, slots, 1)
    augmented = torch.cat([values, ones], dim=-1)  # [B, Hkv, S, D + 1]
    w = weights.reshape(batch * kv_heads, rows, blocks, SLOT_BLOCK)
    w = F.pad(w, (0, 0, 0, 0, 0, padded_rows - rows)).transpose(1, 2)
    w = w.reshape(batch * kv_heads * blocks, padded_rows, SLOT_BLOCK)
    v = augmented.reshape(batch * kv_heads * blocks, SLOT_BLOCK, dim + 1)
    parts = torch.bmm(w, v).reshape(batch * kv_heads, blocks, padded_rows, dim + 1)
    total = parts[:, 0]
    for b in range(1, blocks):
        total = total + parts[:, b]
    total = total[:, :rows]
    denominator = total[..., dim:]
    out = torch.where(denominator > 0, total[..., :dim] / denominator, 0.0)
    out = out.reshape(batch, heads, queries, dim).transpose(1, 2)
    return out.to(query.dtype)


def _gather_slots(
    states: torch.Tensor, order: torch.Tensor, in_use: torch.Tensor, slots: int
) -> torch.Tensor:
    """``states`` ``[B, Hkv, T, D]`` at key indices ``order`` ``[B, S']``, zeros past each
    row's count, padded to ``slots``: float32 ``[B, Hkv, slots, D]``."""
    batch, kv_heads, _, dim = states.shape
    index = order[:, None, :, None].expand(batch, kv_heads, order.shape[1], dim)
    gathered = states.gather(2, index).float()
    gathered = gathered.masked_fill(~in_use[:, None, :, None], 0.0)
    return F.pad(gathered, (0, 0, 0, slots - order.shape[1]))
