"""Teacher-forced raw log-probabilities of complete sequences: one forward pass per group."""

from __future__ import annotations

import dataclasses

import torch
from gen_backend_kit.scoring import ScoreBatch, ScoredRow, scored_row

from gen_hf.decode import forward_errors
from gen_hf.loading import LoadedModel
from gen_hf.routing import RouterCapture

__all__ = ["score_sequences"]


def score_sequences(
    loaded: LoadedModel,
    batch: ScoreBatch,
    *,
    device: torch.device,
    max_batch_size: int,
    top_logprobs: int = 0,
    routing: RouterCapture | None = None,
) -> list[ScoredRow]:
    """Raw ``log_softmax`` of the model's logits at every response token, and the
    ``top_logprobs`` likeliest tokens there.

    Rows are right-padded and run ``max_batch_size`` at a time; positions start at 0 in every
    row, as in generation.

    Args:
        loaded: the model.
        batch: validated sequences (``normalize_score_input``).
        device: the model's device.
        max_batch_size: most rows per forward pass.
        routing: when given, each row's ``routed_experts`` at every position it read.

    Returns:
        Per row i, its ``ScoredRow`` on the CPU: the log-probability of response token j given
        everything before it, and the top-k there.

    Raises:
        GenerationError: a forward pass failed (out of memory, a kernel error).
    """
    with torch.inference_mode(), forward_errors():
        if routing is not None:
            routing.clear()
        return _score_groups(loaded, batch, device, max_batch_size, top_logprobs, routing)


def _score_groups(
    loaded: LoadedModel,
    batch: ScoreBatch,
    device: torch.device,
    max_batch_size: int,
    top_logprobs: int,
    routing: RouterCapture | None,
) -> list[ScoredRow]:
    out: list[ScoredRow] = []
    for start in range(0, len(batch.sequences), max_batch_size):
        group = batch.sequences[start : start + max_batch_size]
        prompt_lengths = batch.prompt_lengths[start : start + max_batch_size]
        width = max(len(s) for s in group)
        ids = torch.zeros((len(group), width), dtype=torch.int64)
        mask = torch.zeros((len(group), width), dtype=torch.int64)
        for i, sequence in enumerate(group):
            ids[i, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.int64)
            mask[i, : len(sequence)] = 1
        logits = loaded.model(
            input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False
        ).logits  # [G, width, V]
        routed = None if routing is None else routing.take(len(group))  # [G, width, layers, k]
        for i, sequence in enumerate(group):
            p, total = prompt_lengths[i], len(sequence)
            rows = logits[i, p - 1 : total - 1].float().log_softmax(dim=-1)  # [g_i, V]
            row = scored_row(rows, ids[i, p:total], top_logprobs)
            if routed is not None:
                row = dataclasses.replace(row, routed_experts=routed[i, :total])
            out.append(row)
    return out
