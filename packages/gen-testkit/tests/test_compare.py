import torch
from gen_backend_kit import RowResult, build_generation_output, normalize_generation_input
from gen_testkit.compare import compare_generations
from gen_testkit.strategies import pad_prompts


def _output(rows):
    prompts = normalize_generation_input(pad_prompts([[1, 2]] * len(rows), "left"), pad_token_id=0)
    return build_generation_output(prompts, [RowResult(t, lp, False) for t, lp in rows], 0)


def test_identical_outputs_are_equal():
    out = _output([([5, 6], [-1.0, -2.0])])
    report = compare_generations(out, out, logprob_atol=1e-6, near_tie=1e-4)
    assert report.ok and [r.status for r in report.rows] == ["equal"]


def test_logprob_differences_beyond_the_tolerance_are_mismatches():
    a = _output([([5, 6], [-1.0, -2.0])])
    b = _output([([5, 6], [-1.0, -2.001])])
    assert not compare_generations(a, b, logprob_atol=1e-4, near_tie=1e-4).ok
    assert compare_generations(a, b, logprob_atol=1e-2, near_tie=1e-4).ok


def test_a_divergence_is_a_near_tie_only_when_both_tokens_were_nearly_as_likely():
    a = _output([([5, 6, 7], [-1.0, -0.70000, -3.0])])
    tie = _output([([5, 9, 2], [-1.0, -0.70003, -0.1])])
    clear = _output([([5, 9, 2], [-1.0, -1.5, -0.1])])
    report = compare_generations(a, tie, logprob_atol=1e-6, near_tie=1e-4)
    assert report.ok and report.near_ties[0].diverged_at == 1
    report = compare_generations(a, clear, logprob_atol=1e-6, near_tie=1e-4)
    assert not report.ok and "gap 0.8" in report.mismatches[0].detail


def test_one_output_stopping_early_is_a_mismatch():
    a = _output([([5, 6], [-1.0, -2.0])])
    b = _output([([5], [-1.0])])
    report = compare_generations(a, b, logprob_atol=1e-6, near_tie=1e-4)
    assert not report.ok
    try:
        report.assert_ok("x")
    except AssertionError as exc:
        assert "lengths 2 vs 1" in str(exc)
    else:
        raise AssertionError("assert_ok did not raise")
    assert torch.equal(a["output_ids"], a["output_ids"])
