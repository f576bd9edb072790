"""Seeded draft sampling: a row's seed reproduces it under ``draft_sample_method: probabilistic``.

vLLM (0.32) samples a drafter's probabilistic drafts in ``compute_probs_and_sample_next_token``
(``vllm.v1.spec_decode.llm_base_proposer``) with exponential noise from the process's global
stream ("TODO: Consider seeds"), while the rejection sampler that verifies them draws a seeded
row's uniforms and recovered tokens from the row's own generator. So the drafts of a seeded row
differ from run to run, and with them the row's tokens: lossless, but a seed no longer replays
a rollout.

``seed_draft_sampling()`` replaces that function in vLLM's module with ``seeded_sample``, which
does what vLLM's own sampler does for the target's tokens (``random_sample``): every row draws
its noise from the global stream, then each seeded row draws its own again from its generator
(``sampling_metadata.generators``, by row). The drafts' distribution is the drafter's either
way; what changes is that a seeded row's draws depend only on its seed and its own steps, so a
seeded row repeats, as it does without speculation or with greedy drafts. Applied in every
worker before its engine steps (``transfer.py``), on every device: the function is vLLM's
Python, not a kernel.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["seed_draft_sampling", "seeded_sample"]


def seeded_sample(
    logits: torch.Tensor, sampling_metadata: Any, use_fp64_gumbel: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``compute_probs_and_sample_next_token`` with seeded rows' noise from their own
    generators (vLLM's ``random_sample`` draws it).

    Args:
        logits: ``[R, V]`` the drafter's logits, one row per request (changed in place, as
            vLLM's function changes them: divided by the temperature).
        sampling_metadata: vLLM's ``SamplingMetadata`` of the R requests.
        use_fp64_gumbel: draw the noise in float64.

    Returns:
        ``([R] draft token ids, [R, V] draft probabilities)``; greedy rows (temperature below
        vLLM's ``_SAMPLING_EPS``) take their argmax. An all-greedy batch returns the logits as
        its "probabilities", as vLLM's does (the rejection sampler does not read them for greedy
        rows).
    """
    from vllm.v1.sample.ops.topk_topp_sampler import random_sample
    from vllm.v1.sample.sampler import _SAMPLING_EPS

    if sampling_metadata.all_greedy:
        return logits.argmax(dim=-1), logits
    temperature = sampling_metadata.temperature
    if not sampling_metadata.all_random:
        is_greedy = temperature < _SAMPLING_EPS
        temperature = torch.where(is_greedy, 1.0, temperature)
    logits.div_(temperature.view(-1, 1))
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    # random_sample divides its argument by the noise in place: the probabilities stay whole
    generators: dict[int, torch.Generator] = sampling_metadata.generators or {}
    tokens = random_sample(probs.clone(), generators, use_fp64_gumbel)
    if not sampling_metadata.all_random:
        tokens = torch.where(is_greedy, probs.argmax(dim=-1), tokens)
    return tokens, probs


def seed_draft_sampling() -> bool:
    """Point vLLM's draft sampling at ``seeded_sample`` (idempotent); False where this vLLM
    has no ``compute_probs_and_sample_next_token`` to replace (a version that moved it: then
    seeds do not reproduce probabilistic drafts, as the README says)."""
    from vllm.v1.spec_decode import llm_base_proposer

    if not hasattr(llm_base_proposer, "compute_probs_and_sample_next_token"):
        return False
    llm_base_proposer.compute_probs_and_sample_next_token = seeded_sample  # type: ignore[attr-defined]
    return True
