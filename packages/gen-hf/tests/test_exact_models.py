"""``gen_hf.exact``: a transformers model on gen-interface's batch-invariant kernels, restored
after; the trainer's ``sequence_logprobs``; models the kernels cannot serve."""

from __future__ import annotations

import pytest
import torch
from gen_hf.exact import (
    ATTENTION_NAME,
    batch_invariance_problems,
    batch_invariant,
    make_batch_invariant,
    sequence_logprobs,
)
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def llama_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama.path)).eval()


def test_the_context_restores_the_models_own_kernels(llama_model):
    before = llama_model.config._attn_implementation
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        own = llama_model(ids).logits
        with batch_invariant(llama_model):
            assert llama_model.config._attn_implementation != before
            exact = llama_model(ids).logits
        assert llama_model.config._attn_implementation == before
        assert not any("forward" in vars(m) for m in llama_model.modules())
        assert torch.equal(llama_model(ids).logits, own)
    torch.testing.assert_close(exact, own, rtol=1e-4, atol=1e-4)
    assert batch_invariance_problems(llama_model) == []


def test_sequence_logprobs_are_zero_off_the_scored_positions_and_carry_gradients(llama_model):
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 10, 11, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    logprobs = sequence_logprobs(llama_model, ids, mask)
    assert logprobs.requires_grad and logprobs.dtype == torch.float32
    scored = torch.tensor([[0, 0, 0, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(logprobs[~scored], torch.zeros(int((~scored).sum())))
    assert bool((logprobs[scored] < 0).all())
    # the same tokens padded the other way round give the same bits
    flipped = sequence_logprobs(
        llama_model,
        torch.tensor([[5, 6, 7, 0], [0, 9, 10, 11]]),
        torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]]),
    )
    assert torch.equal(flipped[0, 1:3], logprobs[0, 3:5].detach())
    assert torch.equal(flipped[1, 2:4], logprobs[1, 1:3].detach())


def test_sliding_window_models_are_refused_by_name():
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"sliding_attention.*full attention only"):
        make_batch_invariant(model)
    assert model.config._attn_implementation != ATTENTION_NAME
