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


def _spans(*spans: tuple[int, int, str]) -> list[dict[str, object]]:
    return [{"start": start, "end": end, "version": version} for start, end, version in spans]


def test_a_row_in_chunks_of_several_tokens_takes_each_token_s_version_from_sglang_s_spans():
    """A chunk carries one version label for all its tokens: where an update fell inside a
    chunk, only SGLang's spans at the row's end say which tokens came from which weights."""
    stream = RowStream(0)
    logprobs = [[-0.5, t, None] for t in (5, 6, 7)]
    stream.add(_chunk([5], output_token_logprobs=logprobs[:1]))
    # tokens 1 and 2 in one chunk, the update between them; the row ends with them
    end = {"type": "length"}
    spans = _spans((0, 2, "3"), (2, 3, "4"))
    meta = {"output_token_logprobs": logprobs[1:], "finish_reason": end, "weight_versions": spans}
    stream.add(_chunk([6, 7], **meta))
    assert stream.versions == [3, 3, 3]  # each chunk's label
    assert stream.result().weight_versions == [3, 3, 4]


def test_a_row_that_ran_past_its_stop_token_keeps_the_spans_of_the_tokens_it_keeps():
    stream = RowStream(0, stop_token_ids=frozenset({2}))
    logprobs = [[-0.5, t, None] for t in (5, 2, 9)]
    spans = _spans((0, 1, "3"), (1, 3, "4"))  # SGLang generated one token past the stop token
    end = {"type": "length"}
    meta = {"output_token_logprobs": logprobs, "finish_reason": end, "weight_versions": spans}
    stream.add(_chunk([5, 2, 9], **meta))
    result = stream.result()
    assert result.token_ids == [5, 2] and result.weight_versions == [3, 4]


def test_a_row_ended_here_without_sglang_s_spans_keeps_each_chunk_s_label():
    stream = RowStream(0, stop_token_ids=frozenset({2}))
    stream.add(_chunk([5], output_token_logprobs=[[-0.5, 5, None]]))
    stream.add(_chunk([2], output_token_logprobs=[[-0.5, 2, None]], weight_version="4"))
    result = stream.result()
    assert result.token_ids == [5, 2] and result.weight_versions == [3, 4]
