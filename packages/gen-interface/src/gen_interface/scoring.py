"""Input and output layout of ``GenerationInterface.score`` (teacher-forced log-probabilities)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gen_interface.errors import GenerationInputError

__all__ = ["ScoreBatch", "normalize_score_input", "scatter_response_logprobs"]


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
