import pytest
import torch
from gen_backend_kit import RowResult, build_generation_output, normalize_generation_input
from gen_backend_kit.decoding import StopRules
from gen_backend_kit.row_sampling import resolve_sampling
from gen_interface import GenerationError
from gen_testkit.strategies import pad_prompts


def test_output_layout_follows_the_contract():
    prompts = normalize_generation_input(pad_prompts([[5, 6, 7], [8]], "left"), pad_token_id=0)
    out = build_generation_output(
        prompts,
        [RowResult([1, 2], [-0.5, -0.25], False), RowResult([3, 4, 9], [-1, -2, -3], True)],
        9,
    )
    assert out["output_ids"].tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 9, 9]]
    assert out["logprobs"].tolist() == [[0, 0, 0, -0.5, -0.25], [0, -1, -2, -3, 0]]
    assert out["generation_lengths"].tolist() == [2, 3]
    assert out["unpadded_sequence_lengths"].tolist() == [5, 4]
    assert out["truncated"].tolist() == [False, True]
    assert out["output_ids"].dtype == torch.int64 and out["logprobs"].dtype == torch.float32


def test_empty_output_has_every_field():
    prompts = normalize_generation_input(
        {
            "input_ids": torch.zeros((0, 3), dtype=torch.int64),
            "input_lengths": torch.zeros(0, dtype=torch.int64),
        },
        pad_token_id=0,
    )
    out = build_generation_output(prompts, [], 0)
    assert out["output_ids"].shape == (0, 0) and out["truncated"].dtype == torch.bool


def test_a_row_result_needs_one_logprob_per_token():
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        RowResult([1, 2], [-1.0], False)


def test_a_finish_reason_the_contract_does_not_know_is_an_error_not_a_length_cut_off():
    """Fails on the main before the shared base: vLLM's "error" finish reason read as "length"."""
    assert RowResult.ended("length", [1], [-0.5]).truncated
    assert RowResult.ended("abort", [1], [-0.5]).cut_short
    stop = RowResult.ended("stop", [1], [-0.5])
    assert not stop.truncated and not stop.cut_short
    for reason in ("error", None, "repetition"):
        with pytest.raises(GenerationError, match="failed inside the engine"):
            RowResult.ended(reason, [1, 2], [-0.5, -0.25])


def test_stop_rules():
    batch = pad_prompts([[1], [2]], "right")
    batch["stop_strings"] = [["ab"], None]
    prompts = normalize_generation_input(batch, pad_token_id=0)
    config = {"stop_token_ids": [7], "max_new_tokens": 3, "stop_strings": ["zz"], "seed": 0}
    sampling = resolve_sampling(config, prompts, greedy=True)
    assert [row.stop_strings for row in sampling.rows] == [("zz", "ab"), ("zz",)]
    rules = StopRules.for_call(
        sampling, context_limit=4, decode=lambda ids: "".join("ab"[i % 2] for i in ids)
    )
    assert rules.reason(1, 1, [7]) == "stop"
    assert rules.reason(0, 1, [4, 5]) == "stop"  # decodes to "ab"
    assert rules.reason(1, 1, [4, 5]) is None
    assert rules.reason(1, 1, [4, 4, 4]) == "length"
    assert rules.reason(1, 3, [4]) == "length"  # context limit 4 reached
