"""Per-row sampling resolved once per call, and its plain-data form."""

from __future__ import annotations

import json

import pytest
import torch
from gen_backend_kit import normalize_generation_input
from gen_backend_kit.row_sampling import BatchSampling, RowSampling, resolve_sampling
from gen_interface import GenerationInputError
from gen_interface.seeds import MAX_SEED, derive_row_seeds
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


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("max_new_tokens", torch.tensor([4, 0, 2]), "max_new_tokens row 1 is 0"),
        ("max_new_tokens", torch.tensor([4.0, 1.0, 2.0]), "integer tensor"),
        ("temperature", torch.tensor([0.5, -1.0, 1.0]), "temperature row 1"),
        ("top_p", torch.tensor([0.0, 1.0, 1.0]), r"top_p row 0 is 0; it must be in \(0, 1\]"),
        ("top_k", torch.tensor([1, -2, 3]), "top_k row 1"),
        ("min_p", torch.tensor([0.0, 0.2, 1.5]), "min_p row 2"),
        ("top_logprobs", torch.tensor([1, 2]), r"shape \(3,\)"),
        ("stop_token_ids", [[1], None], "3 entries"),
        ("stop_token_ids", [[1], [-1], None], "stop_token_ids row 1"),
    ],
)
def test_per_row_settings_are_checked_naming_the_row(key, value, match):
    with pytest.raises(GenerationInputError, match=match):
        _prompts(**{key: value})


def test_per_row_settings_replace_the_config_s_for_their_row_only():
    prompts = _prompts(
        temperature=torch.tensor([0.0, 0.7, 1.2]),
        top_k=torch.tensor([-1, 5, 0]),
        max_new_tokens=torch.tensor([1, 2, 3]),
        stop_token_ids=[None, [7], []],
        top_logprobs=torch.tensor([0, 4, 1]),
    )
    rows = resolve_sampling({**CONFIG, "top_k": 20}, prompts, greedy=False).rows
    assert [r.greedy for r in rows] == [True, False, False]
    assert [r.top_k for r in rows] == [None, 5, None]
    assert [r.max_new_tokens for r in rows] == [1, 2, 3]
    assert [r.stop_token_ids for r in rows] == [(2, 9), (7,), ()]
    assert [r.top_logprobs for r in rows] == [0, 4, 1]
    assert {r.top_p for r in rows} == {0.9}  # not given per row: the config's
