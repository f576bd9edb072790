"""Input and output layout of ``GenerationInterface.score`` (teacher-forced log-probabilities)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gen_interface.batched_data_dict import BatchedDataDict
from gen_interface.errors import GenerationInputError
from gen_interface.specs import ScoreOutputSpec

from gen_backend_kit.outputs import lay_out_routed_experts

__all__ = [
    "ScoreBatch",
    "ScoredRow",
    "checked_score_input",
    "normalize_score_input",
    "scatter_response_logprobs",
    "scatter_scores",
    "scored_row",
]


@dataclass(frozen=True)
class ScoreBatch:
    """Validated sequences to score.

    Attributes:
        sequences: each row's full sequence (prompt then response), unpadded.
        prompt_lengths: p_i, >= 1.
        width: ``L``, the width of the input (and of ``score``'s output).
    """

    sequences: list[list[int]]
    prompt_lengths: list[int]
    width: int


@dataclass(frozen=True)
class ScoredRow:
    """One row's teacher-forced scores.

    Attributes:
        logprobs: float32 ``[g]``: each response token's raw log-probability.
        topk_ids: int64 ``[g, k]``: the k likeliest tokens at each response position, most
            likely first (``k = 0`` when none were asked for).
        topk_logprobs: float32 ``[g, k]``: their raw log-probabilities.
        routed_experts: int ``[p + g, layers, top_k]``: the experts every MoE layer routed each
            position of the sequence to; None when not asked for.
    """

    logprobs: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    routed_experts: torch.Tensor | None = None


def scored_row(log_probs: torch.Tensor, targets: torch.Tensor, top_logprobs: int) -> ScoredRow:
    """A row's scores from its raw log-probabilities ``[g, V]`` at the response positions and
    its response tokens ``[g]``."""
    log_probs = log_probs.float()
    chosen = log_probs.gather(1, targets[:, None].to(log_probs.device)).squeeze(1)
    values, ids = log_probs.topk(min(top_logprobs, log_probs.shape[-1]), dim=-1)
    return ScoredRow(chosen.cpu(), ids.cpu(), values.cpu())


def checked_score_input(
    data: Mapping[str, Any],
    top_logprobs: int,
    *,
    max_top_logprobs: int | None,
    vocab_size: int | None,
    context_limit: int | None,
) -> ScoreBatch:
    """``normalize_score_input`` plus the checks of a backend's limits: ``top_logprobs`` an
    integer in ``[0, max_top_logprobs]``, every sequence shorter than ``context_limit``.

    Raises:
        GenerationInputError: naming what is out of bounds.
    """
    limit = max_top_logprobs
    if (
        isinstance(top_logprobs, bool)
        or not isinstance(top_logprobs, int)
        or top_logprobs < 0
        or (limit is not None and top_logprobs > limit)
    ):
        most = "" if limit is None else f" and <= {limit} (max_logprobs)"
        raise GenerationInputError(
            f"top_logprobs must be an integer >= 0{most}, got {top_logprobs!r}"
        )
    batch = normalize_score_input(data, vocab_size=vocab_size)
    too_long = [
        i for i, s in enumerate(batch.sequences) if context_limit and len(s) >= context_limit
    ]
    if too_long:
        raise GenerationInputError(
            f"score row {too_long[0]} has {len(batch.sequences[too_long[0]])} tokens; "
            f"sequences must be shorter than the context limit {context_limit}"
        )
    return batch


def normalize_score_input(data: Mapping[str, Any], *, vocab_size: int | None = None) -> ScoreBatch:
    """Validate a ``ScoreSpec`` batch (``output_ids`` accepted for ``input_ids``).

    Raises:
        GenerationInputError: naming the field and row at fault.
    """
    ids = data.get("input_ids", data.get("output_ids"))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point:
        raise GenerationInputError("score needs input_ids (or output_ids), an int64 tensor [B, L]")
    batch, width = ids.shape
    prompt_lengths = _lengths(data, "prompt_lengths", batch)
    totals = _lengths(data, "unpadded_sequence_lengths", batch)
    for i in range(batch):
        if not 1 <= prompt_lengths[i] <= totals[i] <= width:
            raise GenerationInputError(
                f"score row {i}: need 1 <= prompt_lengths ({prompt_lengths[i]}) <= "
                f"unpadded_sequence_lengths ({totals[i]}) <= width ({width})"
            )
    sequences = [ids[i, : totals[i]].tolist() for i in range(batch)]
    if vocab_size is not None:
        for i, sequence in enumerate(sequences):
            bad = [t for t in sequence if not 0 <= t < vocab_size]
            if bad:
                raise GenerationInputError(
                    f"score row {i} holds token id {bad[0]}, "
                    f"outside the vocabulary [0, {vocab_size})"
                )
    return ScoreBatch(sequences=sequences, prompt_lengths=prompt_lengths, width=width)


def scatter_response_logprobs(batch: ScoreBatch, per_row: Sequence[torch.Tensor]) -> torch.Tensor:
    """Lay per-row response logprobs (row i: ``[g_i]``) out as float32 ``[B, L]``.

    Position ``p_i + j`` holds response token j's log-probability; every other position is 0.0.
    """
    out = torch.zeros((len(batch.sequences), batch.width), dtype=torch.float32)
    for i, values in enumerate(per_row):
        start = batch.prompt_lengths[i]
        out[i, start : start + values.numel()] = values.float()
    return out


def _lengths(data: Mapping[str, Any], key: str, batch: int) -> list[int]:
    value = data.get(key)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != (batch,):
        raise GenerationInputError(f"score needs {key}, an integer tensor of shape ({batch},)")
    return [int(v) for v in value.tolist()]


def scatter_scores(
    batch: ScoreBatch,
    rows: Sequence[ScoredRow],
    top_logprobs: int,
    routed_experts: tuple[int, int] | None = None,
) -> BatchedDataDict[ScoreOutputSpec]:
    """Lay per-row scores out as a ``ScoreOutputSpec`` batch (``scatter_response_logprobs`` for
    the logprobs; the top-k fields ``[B, L, top_logprobs]``, -1 and 0.0 outside responses; with
    ``routed_experts`` = ``(layers, top_k)``, the routing ``[B, L, layers, top_k]``)."""
    count = len(batch.sequences)
    ids = torch.full((count, batch.width, top_logprobs), -1, dtype=torch.int64)
    values = torch.zeros((count, batch.width, top_logprobs), dtype=torch.float32)
    for i, row in enumerate(rows):
        start, g = batch.prompt_lengths[i], row.logprobs.numel()
        k = min(top_logprobs, row.topk_ids.shape[-1]) if g else 0
        ids[i, start : start + g, :k] = row.topk_ids[:, :k]
        values[i, start : start + g, :k] = row.topk_logprobs[:, :k]
    out: BatchedDataDict[ScoreOutputSpec] = BatchedDataDict(
        logprobs=scatter_response_logprobs(batch, [row.logprobs for row in rows]),
        topk_ids=ids,
        topk_logprobs=values,
    )
    if routed_experts is not None:
        per_row = [row.routed_experts for row in rows]
        out["routed_experts"] = lay_out_routed_experts(per_row, batch.width, routed_experts)
    return out
