"""``RowStream`` reading SGLang's chunks: a sampled row's tokens, logprobs and top logprobs come
from the server-side sampler's choices, checked against the tokens SGLang committed; a greedy
row's from SGLang's own logprobs (no server needed)."""

from __future__ import annotations

import math

import pytest
from gen_interface import GenerationError
from gen_sglang.rows import CHOICE_KEY, RowStream


def _chunk(ids: list[int], **meta: object) -> dict[str, object]:
    return {"output_ids": ids, "meta_info": {"weight_version": "3", **meta}}


def test_a_sampled_row_takes_the_samplers_logprobs_and_top_logprobs():
    stream = RowStream(2, sampled=True)
    choices = [[7, -1.5, [7, 9], [-1.5, -2.0]], [9, -0.25, [9, 4], [-0.25, None]]]
    # SGLang's own logprobs (of the one token the processor allowed) are not used.
    own = [[0.0, 7, None], [0.0, 9, None]]
    assert (
        stream.add(_chunk([7], **{CHOICE_KEY: choices[:1], "output_token_logprobs": own[:1]})) == 1
    )
    assert (
        stream.add(_chunk([9], **{CHOICE_KEY: choices[1:], "output_token_logprobs": own[1:]})) == 1
    )
    assert stream.token_ids == [7, 9]
    assert stream.logprobs == [-1.5, -0.25]
    assert stream.topk_ids == [[7, 9], [9, 4]]
    assert stream.topk_logprobs == [[-1.5, -2.0], [-0.25, -math.inf]]  # null is -inf
    assert stream.versions == [3, 3]


def test_a_token_the_sampler_did_not_choose_is_an_error():
    stream = RowStream(0, sampled=True)
    with pytest.raises(GenerationError, match=r"positions 0\.\.0 where the row's sampler chose"):
        stream.add(_chunk([8], **{CHOICE_KEY: [[7, -1.5, [], []]]}))


def test_a_sampled_row_without_choices_is_an_error():
    stream = RowStream(0, sampled=True)
    with pytest.raises(GenerationError, match="did not run the row's sampler"):
        stream.add(_chunk([8], output_token_logprobs=[[-0.5, 8, None]]))


def test_a_sampler_failure_in_the_server_names_it():
    stream = RowStream(0, sampled=True)
    with pytest.raises(GenerationError, match="failed inside the SGLang server: boom"):
        stream.add(_chunk([8], **{CHOICE_KEY: [["error", "boom"]]}))


def test_a_greedy_row_takes_sglangs_logprobs_where_the_key_holds_none_for_it():
    stream = RowStream(1)
    meta = {
        CHOICE_KEY: [None],  # SGLang pads the key for rows the processor did not sample
        "output_token_logprobs": [[-0.5, 8, None]],
        "output_top_logprobs": [[[-0.5, 8, None]]],
    }
    assert stream.add(_chunk([8], **meta)) == 1
    assert stream.logprobs == [-0.5]
    assert stream.topk_ids == [[8]]
