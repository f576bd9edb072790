from gen_backend_kit import normalize_generation_input
from gen_testkit.strategies import generation_batches
from hypothesis import given, settings
from hypothesis import strategies as st


@given(drawn=generation_batches(50, max_rows=5))
def test_drawn_batches_are_valid_and_hold_their_prompts(drawn):
    normal = normalize_generation_input(drawn.data, pad_token_id=0, vocab_size=50)
    assert normal.prompts() == drawn.prompts
    assert all(3 <= t < 50 for row in drawn.prompts for t in row)


def test_profiles_are_registered():
    for name in ("dev", "ci", "nightly"):
        settings.get_profile(name)
    assert settings.get_profile("ci").derandomize
    assert settings.get_profile("nightly").max_examples >= 500
    assert st is not None


def test_gpu_marker_skips_without_cuda(pytester):
    import torch

    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpu
        def test_needs_gpu():
            import torch
            assert torch.cuda.is_available()
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    if torch.cuda.is_available():
        result.assert_outcomes(passed=1)
    else:
        result.assert_outcomes(skipped=1)
