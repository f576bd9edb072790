"""Per-row sampling resolved once per call, and its plain-data form."""

from __future__ import annotations

import json

import pytest
import torch
from gen_interface import GenerationInputError, normalize_generation_input
from gen_interface.row_sampling import BatchSampling, RowSampling, resolve_sampling
from gen_interface.sampling import MAX_SEED, derive_row_seeds
from gen_testkit.strategies import pad_prompts
from hypothesis import given
from hypothesis import strategies as st

CONFIG = {
    "max_new_tokens": 5,
    "temperature": 0.7,
    "top_k": -1,
    "top_p": 0.9,
    "stop_token_ids": [2, 9],
    "stop_strings": ["##"],
    "seed": 11,
    "logprobs_mode": "processed",
}


def _prompts(rows=3, **extra):
    batch = pad_prompts([[1, 2, 3][: i + 1] for i in range(rows)], "left")
    batch.update(extra)
    return normalize_generation_input(batch, pad_token_id=0)


def test_resolution_spells_out_every_setting_of_every_row():
    sampling = resolve_sampling(
        CONFIG, _prompts(stop_strings=[None, ["!"], ["##", "?"]]), greedy=False
    )
    assert sampling.logprobs_mode == "processed" and sampling.processed
    assert [r.stop_strings for r in sampling.rows] == [("##",), ("##", "!"), ("##", "?")]
    assert {(r.temperature, r.top_k, r.top_p, r.max_new_tokens) for r in sampling.rows} == {
        (0.7, None, 0.9, 5)
    }
    assert all(r.stop_token_ids == (2, 9) for r in sampling.rows)
    assert sampling.needs_tokenizer
    assert [r.seed for r in sampling.rows] == derive_row_seeds(11, 3)


@pytest.mark.parametrize(("temperature", "greedy"), [(0.7, True), (0.0, False), (1e-7, False)])
def test_greedy_rows_have_temperature_zero(temperature, greedy):
    sampling = resolve_sampling({**CONFIG, "temperature": temperature}, _prompts(), greedy=greedy)
    assert all(r.greedy and r.temperature == 0.0 for r in sampling.rows)


def test_caller_seeds_win_and_a_row_keeps_its_seed_when_selected():
    prompts = _prompts(sample_seeds=torch.tensor([5, 6, 7]))
    sampling = resolve_sampling(CONFIG, prompts, greedy=False)
    alone = resolve_sampling(CONFIG, prompts.select([2]), greedy=False)
    assert sampling.select([2]) == alone


_rows = st.builds(
    RowSampling,
    max_new_tokens=st.integers(1, 4096),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    top_k=st.none() | st.integers(1, 1000),
    top_p=st.sampled_from([1.0, 0.95, 0.1]),
    stop_token_ids=st.lists(st.integers(0, 10**6), max_size=3).map(tuple),
    stop_strings=st.lists(st.text(min_size=1, max_size=4), max_size=2).map(tuple),
    seed=st.integers(0, MAX_SEED),
)


@given(rows=st.lists(_rows, max_size=6), mode=st.sampled_from(["raw", "processed"]))
def test_the_wire_form_is_json_and_round_trips(rows, mode):
    sampling = BatchSampling(tuple(rows), mode)
    wire = json.loads(json.dumps(sampling.to_wire()))
    assert BatchSampling.from_wire(wire) == sampling


@pytest.mark.parametrize(
    ("column", "value", "match"),
    [
        ("max_new_tokens", [0], "max_new_tokens"),
        ("temperature", [-1.0], "temperature"),
        ("top_k", [0], "top_k"),
        ("top_p", [1.5], "top_p"),
        ("stop_token_ids", [[-3]], "stop_token_ids"),
        ("stop_strings", [[""]], "stop_strings"),
        ("seed", [MAX_SEED + 1], "seed"),
        ("seed", [1, 2], "differ in length"),
        ("seed", None, "missing"),
    ],
)
def test_a_bad_wire_form_is_refused_naming_the_column(column, value, match):
    wire = BatchSampling((RowSampling(3, 1.0, None, 1.0, (), (), 4),)).to_wire()
    wire[column] = value
    with pytest.raises(GenerationInputError, match=match):
        BatchSampling.from_wire(wire)
