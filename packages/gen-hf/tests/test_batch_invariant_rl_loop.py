"""A REINFORCE loop in batch-invariant mode: rollout and trainer logprobs agree exactly, every
step, while the policy moves and each step's weights reach the backend through ``Refitter``."""

from __future__ import annotations

import math
from typing import cast

import torch
from gen_hf import HfConfig, HfGeneration
from gen_hf.exact import sequence_logprobs
from gen_interface.weights import Refitter
from gen_testkit.strategies import pad_prompts
from transformers import AutoModelForCausalLM

PROMPTS = [[5, 17, 42, 8], [99], [7, 7, 7, 7, 7, 7], [300, 12], [64, 65, 66], [3, 400]]
STEPS = 4


def test_reinforce_steps_see_rollout_logprobs_equal_to_the_trainers(make_config, tiny_qwen2):
    torch.manual_seed(0)
    trainer = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2.path), dtype=torch.float32)
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.5)
    config = make_config(tiny_qwen2, max_new_tokens=10, batch_invariant=True, seed=None)
    backend = HfGeneration(cast(HfConfig, config))
    ratios, losses, versions = [], [], []
    initial = {k: v.clone() for k, v in trainer.state_dict().items()}
    try:
        with Refitter(backend) as refitter:
            for _ in range(STEPS):
                out = backend.generate(pad_prompts(PROMPTS * 2, "left"), greedy=False)
                ends = out["unpadded_sequence_lengths"].tolist()
                sequences = [out["output_ids"][i, :end].tolist() for i, end in enumerate(ends)]
                batch = pad_prompts(sequences, "right")
                ids, mask = batch["input_ids"], batch["attention_mask"]
                trainer_logprobs = sequence_logprobs(trainer, ids, mask)  # with gradients
                generated = torch.zeros_like(mask, dtype=torch.bool)
                for i, end in enumerate(ends):
                    generated[i, len(PROMPTS[i % len(PROMPTS)]) : end] = True
                rollout = out["logprobs"][:, : ids.shape[1]][generated]
                trained = trainer_logprobs[generated]
                ratios.append(float(torch.exp((rollout - trained.detach()).abs()).mean()))
                # Reward: the share of even token ids a row generated; baseline: the batch mean.
                rewards = torch.tensor(
                    [
                        float((ids[i][generated[i]] % 2 == 0).float().mean())
                        for i in range(len(sequences))
                    ]
                )
                advantages = rewards - rewards.mean()
                per_row = (trainer_logprobs * generated).sum(dim=1)
                loss = -(advantages * per_row).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                versions.append(refitter.refit(trainer.state_dict()))
        served = backend.state_dict()
    finally:
        backend.shutdown()
    assert ratios == [1.0] * STEPS, f"mean e^|rollout - trainer| per step: {ratios}"
    assert versions == sorted(set(versions)) and len(versions) == STEPS  # every step refitted
    assert all(math.isfinite(x) for x in losses)
    final = trainer.state_dict()
    assert all(torch.equal(served[k], final[k]) for k in final)  # the last refit landed
    assert not all(torch.equal(initial[k], final[k]) for k in final), "the policy never moved"
