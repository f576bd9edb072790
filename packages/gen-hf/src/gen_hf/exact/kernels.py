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
#: Most attention scores held at once (float32: 256 MiB); longer inputs run in query chunks.
_MAX_SCORES = 2**26


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
    query of a row attends to (padding) are dropped before the reduction, so key j of a row's
    sequence lands in slot j. That holds for full (causal or bidirectional) attention over
    padded rows; a sliding window would hide keys that are not padding, so it is not supported.

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
    batch, heads, queries, _ = query.shape
    length = key.shape[2]
    if attends is None:
        attends = (
            torch.ones(queries, length, dtype=torch.bool, device=query.device)
            .tril(length - queries)[None, None]
            .expand(batch, 1, queries, length)
        )
    attends = attends.expand(batch, 1, queries, length)

    # Slots: each row's keys in order, padding (keys no query attends to) removed. Slots past a
    # row's count point at its last real key (finite values, never attended), slots past the
    # input's length hold zeros.
    real = attends[:, 0].any(dim=1)  # [B, T]
    order = torch.argsort((~real).to(torch.int8), dim=-1, stable=True)  # real keys first
    counts = real.sum(dim=-1)  # [B]
    slots = -(-max(int(counts.max()), 1) // SLOT_BLOCK) * SLOT_BLOCK
    taken = min(slots, length)
    order = order[:, :taken]
    in_use = torch.arange(taken, device=query.device)[None] < counts[:, None]  # [B, S']
    last = order.gather(1, (counts - 1).clamp(min=0)[:, None])
    order = torch.where(in_use, order, last)
    keys = _slotted(key, order, slots)  # [B, Hkv, S, D] float32
    values = _slotted(value, order, slots, ones_column=True)  # [B, Hkv, S, D + 1]
    allowed = attends[:, 0].gather(-1, order[:, None, :].expand(batch, queries, taken))
    allowed = F.pad(allowed & in_use[:, None, :], (0, slots - taken))  # [B, Q, S]

    # Queries of one kv head together, [B * Hkv, G * Q, D], in chunks of queries that keep the
    # scores under _MAX_SCORES elements (each query's result does not depend on its chunk).
    chunk = max(1, _MAX_SCORES // max(1, batch * heads * slots))
    parts = [
        _attend(
            query[:, :, start : start + chunk],
            keys,
            values,
            allowed[:, start : start + chunk],
            scaling=scaling,
            softcap=softcap,
        )
        for start in range(0, queries, chunk)
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # [B, H, Q, D]
    return out.transpose(1, 2).to(query.dtype)


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of ``query`` ``[B, H, Q, D]`` over slotted float32 ``keys`` ``[B, Hkv, S, D]``
    and ``values`` ``[B, Hkv, S, D + 1]`` (a last column of ones) where ``allowed`` bool
    ``[B, Q, S]``: float32 ``[B, H, Q, D]``."""
    batch, heads, queries, dim = query.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    rows = group * queries
    padded_rows = max(rows, MIN_ROWS)
    q = F.pad(query.float().reshape(batch * kv_heads, rows, dim), (0, 0, 0, padded_rows - rows))
    scores = torch.bmm(q, keys.reshape(batch * kv_heads, slots, dim).transpose(1, 2))
    scores = scores[:, :rows].reshape(batch, kv_heads, group, queries, slots) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = allowed[:, None, None]  # [B, 1, 1, Q, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
    weights = torch.exp(scores - top)  # [B, Hkv, G, Q, S]; exactly 0 where not allowed

    # Values and the softmax denominator (the column of ones) summed block by block, in order.
    blocks = slots // SLOT_BLOCK
    w = weights.reshape(batch * kv_heads, rows, blocks, SLOT_BLOCK)
    w = F.pad(w, (0, 0, 0, 0, 0, padded_rows - rows)).transpose(1, 2)
    w = w.reshape(batch * kv_heads * blocks, padded_rows, SLOT_BLOCK)
    v = values.reshape(batch * kv_heads * blocks, SLOT_BLOCK, dim + 1)
    sums = torch.bmm(w, v).reshape(batch * kv_heads, blocks, padded_rows, dim + 1)
    total = sums[:, 0]
    for b in range(1, blocks):
        total = total + sums[:, b]
    total = total[:, :rows]
    denominator = total[..., dim:]
    out = torch.where(denominator > 0, total[..., :dim] / denominator, 0.0)
    return out.reshape(batch, heads, queries, dim)


def _slotted(
    states: torch.Tensor, order: torch.Tensor, slots: int, *, ones_column: bool = False
) -> torch.Tensor:
    """``states`` ``[B, Hkv, T, D]`` at key indices ``order`` ``[B, S']``, zeros past ``S'``:
    float32 ``[B, Hkv, slots, D]``, or ``[B, Hkv, slots, D + 1]`` with a last column of ones."""
    batch, kv_heads, _, dim = states.shape
    taken = order.shape[1]
    picked = states[torch.arange(batch, device=order.device)[:, None], :, order]  # [B, S', Hkv, D]
    out = states.new_empty((batch, kv_heads, slots, dim + int(ones_column)), dtype=torch.float32)
    out[:, :, :taken, :dim] = picked.transpose(1, 2)
    out[:, :, taken:, :dim] = 0.0
    if ones_column:
        out[..., dim] = 1.0
    return out
