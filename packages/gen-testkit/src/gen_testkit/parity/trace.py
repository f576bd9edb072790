"""The values behind a pair's summary numbers, kept for pictures (``parity.plots``).

The report's numbers are maxima, means and counts; a picture shows how the differences are
spread, where along the rows they fall and how the samples sit against the exact distribution.
A trace holds a few thousand floats for a default ``gen-parity`` run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PairTrace", "SamplingTrace", "generated_differences"]


@dataclass
class SamplingTrace:
    """One sampling prefix: the exact distribution and each backend's sampled first tokens."""

    expected: list[float]  # [V] probabilities of the processed distribution
    tokens: dict[str, list[int]] = field(default_factory=dict)  # backend -> sampled tokens
    p_values: dict[str, float] = field(default_factory=dict)


@dataclass
class PairTrace:
    """Per-position values of one backend pair (the top-k verdicts per position are the
    report's ``top_k.statuses``).

    Positions count generated tokens from 0 (the first token after the prompt).
    """

    #: teacher-forced raw logprobs: (position, first - second) for every compared token
    teacher_forced: list[tuple[int, float]] = field(default_factory=list)
    #: per backend: (position, reported - exact) of its processed logprobs
    processed: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    #: one per sampling prefix
    sampling: list[SamplingTrace] = field(default_factory=list)


def generated_differences(
    first: torch.Tensor,
    second: torch.Tensor,
    output: Mapping[str, Any],
    prompt_lengths: Sequence[int],
) -> list[tuple[int, float]]:
    """``(position, first - second)`` at every generated position of ``output``'s rows, for two
    ``[B, L]`` logprob tensors laid out like ``output``."""
    out: list[tuple[int, float]] = []
    for i, start in enumerate(prompt_lengths):
        end = int(output["unpadded_sequence_lengths"][i])
        diff = first[i, start:end].double() - second[i, start:end].double()
        out.extend(enumerate(diff.tolist()))
    return out
