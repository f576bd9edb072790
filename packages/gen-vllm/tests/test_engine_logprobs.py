"""``VllmEngine``'s reading of vLLM's flat logprobs at a row's end: the whole-list path taken
when every position holds the token's entry and k more gives what reading position by position
gives, on every layout vLLM may hand over, and a wrong token is refused either way."""

from __future__ import annotations

import pytest
from gen_interface import GenerationError
from gen_vllm.engine import _sampled
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.logprobs import FlatLogprobs


def _flat(positions: list[list[tuple[int, float]]]) -> FlatLogprobs:
    flat = FlatLogprobs()
    for entries in positions:
        flat.append_fast(
            [t for t, _ in entries],
            [v for _, v in entries],
            iter(range(len(entries))),
            [None] * len(entries),
        )
    return flat


def _by_position(flat: FlatLogprobs, tokens: list[int], k: int, first: int):
    """The reference: position by position, as the docstring of ``_sampled`` states it."""
    starts, values, ids = flat.start_indices, flat.logprobs, flat.token_ids
    picked = range(first, len(tokens))
    return (
        [values[starts[t]] for t in picked],
        [ids[starts[t] + 1 : starts[t] + 1 + k] for t in picked] if k else None,
        [values[starts[t] + 1 : starts[t] + 1 + k] for t in picked] if k else None,
    )


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50), min_size=1, max_size=12),
    k=st.integers(0, 3),
    first=st.integers(0, 1),
    extra=st.lists(st.integers(0, 2), min_size=12, max_size=12),
    data=st.data(),
)
def test_rows_read_whole_give_what_reading_each_position_gives(tokens, k, first, extra, data):
    # ``extra``: positions holding more than 1 + k entries (vLLM's layout differs): the slow path
    positions: list[list[tuple[int, float]]] = [[] for _ in range(first)]
    for t, token in enumerate(tokens[first:]):
        width = 1 + k + (extra[t] if data.draw(st.booleans()) else 0)
        entries = [(token, -0.5 - t)]
        entries += [(data.draw(st.integers(0, 50)), -1.0 - r - t) for r in range(width - 1)]
        positions.append(entries)
    flat = _flat(positions)
    assert _sampled(flat, tokens, k, first) == _by_position(flat, tokens, k, first)


@pytest.mark.parametrize("k", [0, 2])
def test_a_logprob_entry_for_another_token_is_refused(k):
    flat = _flat([[(7, -0.1)] + [(1, -2.0)] * k, [(8, -0.2)] + [(1, -2.0)] * k])
    assert _sampled(flat, [7, 8], k)[0] == [-0.1, -0.2]
    with pytest.raises(GenerationError, match="no logprob for token 9"):
        _sampled(flat, [7, 9], k)
