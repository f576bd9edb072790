"""``lm_head_fp32``: in a bfloat16 model the head runs in float32 on the checkpoint's float32
weight and the log-softmax on float32 logits; a float32 model runs unchanged; weight names and
updates are untouched. (How much closer to a float32 model that brings a bfloat16 one's
logprobs: ``tools/bench/fp32_head.py``.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from gen_hf import HfConfig, HfGeneration
from gen_interface import BatchedDataDict, GenerationConfigError
from gen_interface.weights import refit
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts
from transformers import AutoModelForCausalLM

PROMPTS = [[5, 17, 42, 8], [99, 3], [7, 7, 7], [300, 12, 40, 41, 43]]


def test_the_head_runs_in_float32_on_the_checkpoints_float32_weight(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    """A bfloat16 model with ``lm_head_fp32``: its logprobs are the float32 log-softmax of the
    checkpoint's float32 head applied to the bfloat16 body's last hidden states."""
    backend = HfGeneration(make_config(tiny_qwen2, dtype="bfloat16", lm_head_fp32=True))
    checkpoint = tiny_qwen2.state_dict()["lm_head.weight"]
    head = backend._model().model.lm_head
    assert head.weight.dtype == torch.float32 and torch.equal(head.weight, checkpoint)
    assert backend._model().model.model.embed_tokens.weight.dtype == torch.bfloat16
    body = AutoModelForCausalLM.from_pretrained(
        str(tiny_qwen2.path),
        dtype=torch.bfloat16,
        attn_implementation=backend._model().model.config._attn_implementation,
    )
    try:
        for prompt in PROMPTS:
            ids = torch.tensor([[*prompt, 11, 12, 13]])
            sequence = BatchedDataDict(
                input_ids=ids,
                prompt_lengths=torch.tensor([len(prompt)]),
                unpadded_sequence_lengths=torch.tensor([ids.shape[1]]),
            )
            got = backend.score(sequence)[0, len(prompt) :]
            with torch.no_grad():
                hidden = body(input_ids=ids, output_hidden_states=True).hidden_states[-1]
            logits = hidden[0].float() @ checkpoint.T  # [L, V], float32
            want = logits.log_softmax(-1)[len(prompt) - 1 : -1].gather(
                1, ids[0, len(prompt) :, None]
            )[:, 0]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    finally:
        backend.shutdown()


def test_a_float32_model_runs_unchanged_and_weights_keep_their_names(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    plain = HfGeneration(make_config(tiny_qwen2))
    head = HfGeneration(make_config(tiny_qwen2, lm_head_fp32=True))
    batch = pad_prompts(PROMPTS, "left")
    try:
        a, b = plain.generate(batch, greedy=True), head.generate(batch, greedy=True)
        assert torch.equal(a["output_ids"], b["output_ids"])
        assert torch.equal(a["logprobs"], b["logprobs"])
        weights = {k: v.clone() for k, v in tiny_qwen2.state_dict().items()}
        head.prepare_refit_info({k: (v.shape, v.dtype) for k, v in weights.items()})
        weights["lm_head.weight"] *= 1.5  # the head's new weight is what it computes with
        refit(head, weights)
        after = head.generate(batch, greedy=True)
        assert not torch.equal(after["logprobs"], b["logprobs"])
        refit(head, tiny_qwen2.state_dict())
        assert torch.equal(head.generate(batch, greedy=True)["logprobs"], b["logprobs"])
    finally:
        plain.shutdown()
        head.shutdown()


def test_it_is_refused_beside_batch_invariant(
    tiny_qwen2: TinyModel, make_config: Callable[..., HfConfig]
):
    with pytest.raises(GenerationConfigError, match="lm_head_fp32"):
        HfGeneration(make_config(tiny_qwen2, batch_invariant=True, lm_head_fp32=True))
