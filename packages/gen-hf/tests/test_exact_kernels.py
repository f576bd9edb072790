"""The batch-invariant kernels of ``gen_hf.exact``, on their own: bitwise properties."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gen_hf.exact import MIN_ROWS, invariant_attention, invariant_linear
from hypothesis import given, settings
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.bfloat16]


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    inner=st.sampled_from([32, 96, 256, 1024]),
    outer=st.sampled_from([16, 48, 500]),
    start=st.integers(0, 40),
    rows=st.integers(1, 60),
    bias=st.booleans(),
)
def test_a_row_of_invariant_linear_is_the_same_in_any_batch(dtype, inner, outer, start, rows, bias):
    generator = torch.Generator().manual_seed(inner * outer)
    weight = torch.randn(outer, inner, generator=generator).to(dtype)
    b = torch.randn(outer, generator=generator).to(dtype) if bias else None
    x = torch.randn(100, inner, generator=generator).to(dtype)
    everything = invariant_linear(x, weight, b)
    assert torch.equal(
        invariant_linear(x[start : start + rows], weight, b), everything[start : start + rows]
    )
    torch.testing.assert_close(everything, F.linear(x, weight, b), rtol=2e-2, atol=2e-2)


def test_plain_linear_is_not_batch_invariant_here():
    """What the kernel is for: without it, a row alone gets other bits (float32, MKL)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 256, generator=generator)
    x = torch.randn(64, 256, generator=generator)
    assert not torch.equal(F.linear(x[:1], weight), F.linear(x, weight)[:1])
    assert MIN_ROWS >= 12  # the smallest row count measured to agree with every larger one


def _causal_attends(lengths: list[int], width: int, left: bool) -> torch.Tensor:
    """bool [B, 1, width, width]: causal over each row's real tokens, padded left or right."""
    positions = torch.arange(width)
    starts = torch.tensor([width - n if left else 0 for n in lengths])
    ends = starts + torch.tensor(lengths)
    real = (positions[None] >= starts[:, None]) & (positions[None] < ends[:, None])
    causal = positions[:, None] >= positions[None, :]
    return (causal[None] & real[:, None, :] & real[:, :, None])[:, None]


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    lengths=st.lists(st.integers(1, 90), min_size=1, max_size=4),
    heads=st.sampled_from([(4, 4), (4, 2), (8, 1)]),
    data=st.data(),
)
def test_attention_gives_a_query_the_same_bits_prefilled_or_decoded_left_or_right(
    dtype, lengths, heads, data
):
    """Each row read at once, right-padded beside the others, equals the same row left-padded
    in another batch, and each of its queries decoded alone from a cache with extra padding."""
    h, kv = heads
    dim = 32
    generator = torch.Generator().manual_seed(sum(lengths))
    rows = [
        tuple(
            torch.randn(n_heads, n, dim, generator=generator).to(dtype) for n_heads in (h, kv, kv)
        )
        for n in lengths
    ]

    def batch(left: bool, width: int) -> tuple[torch.Tensor, ...]:
        out = []
        for part in range(3):
            stacked = torch.zeros(len(rows), rows[0][part].shape[0], width, dim, dtype=dtype)
            for i, row in enumerate(rows):
                n = lengths[i]
                start = width - n if left else 0
                stacked[i, :, start : start + n] = row[part]
            out.append(stacked)
        return tuple(out)

    width = max(lengths)
    right = invariant_attention(
        *batch(False, width), _causal_attends(lengths, width, False), scaling=0.125
    )
    extra = data.draw(st.integers(0, 5), label="extra left padding")
    left = invariant_attention(
        *batch(True, width + extra), _causal_attends(lengths, width + extra, True), scaling=0.125
    )
    for i, n in enumerate(lengths):
        assert torch.equal(right[i, :n], left[i, width + extra - n :])
        t = data.draw(st.integers(0, n - 1), label=f"decoded query of row {i}")
        pad = data.draw(st.integers(0, 70), label="cache padding")
        q, k, v = rows[i]
        cache_k = torch.cat(
            [torch.full((kv, pad, dim), float("nan"), dtype=dtype), k[:, : t + 1]], 1
        )
        cache_v = torch.cat(
            [torch.full((kv, pad, dim), float("nan"), dtype=dtype), v[:, : t + 1]], 1
        )
        attends = torch.ones(1, 1, 1, pad + t + 1, dtype=torch.bool)
        attends[..., :pad] = False
        one = invariant_attention(
            q[None, :, t : t + 1], cache_k[None], cache_v[None], attends, scaling=0.125
        )
        assert torch.equal(one[0, 0], right[i, t])


def test_attention_matches_softmax_attention_and_zeroes_queries_with_no_key():
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 9, 32, generator=generator) for _ in range(3))
    attends = _causal_attends([9, 5], 9, left=True)
    out = invariant_attention(q, k, v, attends, scaling=32**-0.5)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=attends).transpose(1, 2)
    torch.testing.assert_close(out[0], reference[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1, 4:], reference[1, 4:], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1, :4], torch.zeros_like(out[1, :4]))  # padding queries see nothing


def test_long_inputs_run_in_query_chunks_with_the_same_bits(monkeypatch):
    import gen_hf.exact.kernels as kernels

    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 70, 32, generator=generator) for _ in range(3))
    attends = _causal_attends([70, 41], 70, left=False)
    whole = invariant_attention(q, k[:, :2], v[:, :2], attends, scaling=0.2)
    monkeypatch.setattr(kernels, "_MAX_SCORES", 2 * 4 * 128 * 9)  # chunks of 9 queries
    assert torch.equal(invariant_attention(q, k[:, :2], v[:, :2], attends, scaling=0.2), whole)
