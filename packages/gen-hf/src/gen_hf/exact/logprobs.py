"""The trainer's side: sequence logprobs from a batch-invariant forward of its own model."""

from __future__ import annotations

import torch

from gen_hf.exact.models import batch_invariant

__all__ = ["sequence_logprobs"]


def sequence_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Each token's log-probability given the tokens before it, from a batch-invariant forward.

    These are the values a backend running with ``batch_invariant: true`` returns for the same
    tokens (``logprobs`` of ``generate``, or ``score``), bit for bit, whatever the batch, its
    padding side, or how the backend split prefill and decode. Gradients flow as through the
    model's own forward, so the same call serves the loss.

    Args:
        model: a transformers causal LM, on its device, in the dtype the backend runs.
        input_ids: int64 ``[B, T]``.
        attention_mask: ``[B, T]``, 1 on real tokens, each row's real tokens one contiguous run
            (left, right or no padding); None: no padding.

    Returns:
        float32 ``[B, T]``: at real position t, ``log p(input_ids[b, t] | the row's real tokens
        before t)`` (raw: the ``log_softmax`` of the model's logits); 0 at each row's first real
        token and at padding.
    """
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    with batch_invariant(model):
        logits = model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False
        ).logits  # [B, T, V]
    logprobs = logits[:, :-1].float().log_softmax(dim=-1)
    chosen = logprobs.gather(-1, input_ids[:, 1:, None])[..., 0]  # [B, T - 1]
    scored = (mask[:, 1:] * mask[:, :-1]).bool()  # a real token after a real token
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    out[:, 1:] = torch.where(scored, chosen, 0.0)
    return out
