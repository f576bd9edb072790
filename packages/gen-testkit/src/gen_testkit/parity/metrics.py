"""The numbers a parity run reports, and how each is computed from two backends' outputs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from gen_interface import BatchedDataDict, GenerationInterface

from gen_testkit.compare import generated_rows

__all__ = [
    "GreedyAgreement",
    "LogprobError",
    "SamplingFit",
    "chi_square_fit",
    "greedy_agreement",
    "logprob_error",
    "score_outputs",
]


@dataclass
class GreedyAgreement:
    """Greedy outputs of two backends on the same rows.

    A row agrees when every token matches. Where tokens first differ, the reference scores both
    continuations; a gap of at most ``near_tie`` between the two tokens' log-probabilities (the
    reference's top-2 margin there) is a near-tie, reported apart; a larger one is a mismatch.
    """

    rows: int = 0
    agree: int = 0
    near_ties: int = 0
    mismatches: int = 0
    details: list[str] = field(default_factory=list)
    split_gaps: list[float] = field(default_factory=list)  # the reference's gap at each split

    @property
    def agreement(self) -> float:
        return self.agree / self.rows if self.rows else 1.0

    def add(self, other: GreedyAgreement) -> None:
        self.rows += other.rows
        self.agree += other.agree
        self.near_ties += other.near_ties
        self.mismatches += other.mismatches
        self.details += other.details
        self.split_gaps += other.split_gaps


@dataclass
class LogprobError:
    """Differences of per-token log-probabilities at the same positions.

    ``mean_exp_abs`` is ``mean(exp(|a - b|))``: the multiplicative error of probabilities that RL
    practitioners quote (1.0 is perfect).
    """

    count: int = 0
    max_abs: float = 0.0
    sum_abs: float = 0.0
    sum_exp_abs: float = 0.0

    @property
    def mean_abs(self) -> float:
        return self.sum_abs / self.count if self.count else 0.0

    @property
    def mean_exp_abs(self) -> float:
        return self.sum_exp_abs / self.count if self.count else 1.0

    def add_values(self, a: torch.Tensor, b: torch.Tensor) -> None:
        diff = (a.double() - b.double()).abs()
        if diff.numel():
            self.count += diff.numel()
            self.max_abs = max(self.max_abs, float(diff.max()))
            self.sum_abs += float(diff.sum())
            self.sum_exp_abs += float(diff.exp().sum())

    def add(self, other: LogprobError) -> None:
        self.count += other.count
        self.max_abs = max(self.max_abs, other.max_abs)
        self.sum_abs += other.sum_abs
        self.sum_exp_abs += other.sum_exp_abs

    def summary(self) -> dict[str, float]:
        return {
            "max_abs": self.max_abs,
            "mean_abs": self.mean_abs,
            "mean_exp_abs": self.mean_exp_abs,
        }


@dataclass
class SamplingFit:
    """A goodness-of-fit test of one backend's samples against the exact distribution."""

    samples: int
    statistic: float
    dof: int
    p_value: float
    outside_support: int  # samples of tokens the distribution gives probability 0
    total_variation: float  # between the empirical and the exact distribution, in [0, 1]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def score_outputs(
    scorer: GenerationInterface, output: Mapping[str, Any], prompt_lengths: Sequence[int]
) -> torch.Tensor:
    """``scorer``'s teacher-forced raw logprobs ``[B, L]`` of another backend's output rows."""
    return scorer.score(
        BatchedDataDict(
            input_ids=output["output_ids"],
            prompt_lengths=torch.tensor(list(prompt_lengths), dtype=torch.int64),
            unpadded_sequence_lengths=output["unpadded_sequence_lengths"],
        )
    )


def _generated_mask(output: Mapping[str, Any], prompt_lengths: Sequence[int]) -> torch.Tensor:
    width = output["output_ids"].shape[1]
    columns = torch.arange(width)[None, :]
    start = torch.tensor(list(prompt_lengths))[:, None]
    return (columns >= start) & (columns < output["unpadded_sequence_lengths"][:, None])


def logprob_error(
    first: torch.Tensor,
    second: torch.Tensor,
    output: Mapping[str, Any],
    prompt_lengths: Sequence[int],
) -> LogprobError:
    """Error between two ``[B, L]`` logprob tensors over the generated positions of ``output``."""
    mask = _generated_mask(output, prompt_lengths)
    error = LogprobError()
    error.add_values(first[mask], second[mask])
    return error


def greedy_agreement(
    reference: GenerationInterface,
    expected: Mapping[str, Any],
    actual: Mapping[str, Any],
    prompt_lengths: Sequence[int],
    near_tie: float,
) -> GreedyAgreement:
    """Compare two greedy outputs of the same prompts, scoring divergences with ``reference``."""
    result = GreedyAgreement()
    left, right = generated_rows(expected), generated_rows(actual)
    for i, ((tok_a, _), (tok_b, _)) in enumerate(zip(left, right)):
        result.rows += 1
        common = min(len(tok_a), len(tok_b))
        j = next((k for k in range(common) if tok_a[k] != tok_b[k]), None)
        if j is None and len(tok_a) == len(tok_b):
            result.agree += 1
            continue
        if j is None:
            result.mismatches += 1
            result.details.append(f"row {i}: same first {common} tokens, then lengths differ")
            continue
        prefix = list(expected["output_ids"][i, : prompt_lengths[i] + j].tolist())
        gap = _score_gap(reference, prefix, tok_a[j], tok_b[j])
        result.split_gaps.append(gap)
        if gap <= near_tie:
            result.near_ties += 1
        else:
            result.mismatches += 1
            result.details.append(
                f"row {i}: token {j} is {tok_a[j]} vs {tok_b[j]}; the reference prefers "
                f"{tok_a[j]} by {gap:.3g} in logprob (near-tie margin {near_tie:g})"
            )
    return result


def _score_gap(reference: GenerationInterface, prefix: list[int], a: int, b: int) -> float:
    ids = torch.tensor([[*prefix, a], [*prefix, b]], dtype=torch.int64)
    length = len(prefix) + 1
    scores = reference.score(
        BatchedDataDict(
            input_ids=ids,
            prompt_lengths=torch.tensor([len(prefix)] * 2),
            unpadded_sequence_lengths=torch.tensor([length] * 2),
        )
    )
    return abs(float(scores[0, length - 1] - scores[1, length - 1]))


def chi_square_fit(
    tokens: Sequence[int],
    probs: torch.Tensor,
    min_expected: float = 5.0,
    support_slack: float = 0.0,
) -> SamplingFit:
    """Pearson's chi-square test of sampled ``tokens`` against ``probs`` ``[V]``.

    Tokens are binned by their own id while their expected count reaches ``min_expected``; the
    rest of the support is pooled into one bin. Samples of zero-probability tokens are counted in
    ``outside_support``: more than ``support_slack`` of all samples makes the p-value 0; fewer are
    left out of the test, which then checks the shape of the distribution inside its support.
    """
    from scipy import stats

    n = len(tokens)
    counts = torch.bincount(torch.tensor(list(tokens), dtype=torch.int64), minlength=probs.numel())
    probs = probs.double()
    total_variation = 0.5 * float((counts.double() / max(n, 1) - probs).abs().sum())
    outside = int(counts[probs <= 0].sum())
    tolerated = outside <= support_slack * n
    n -= outside if tolerated else 0
    expected = probs * n
    big = expected >= min_expected
    observed_bins = [float(c) for c in counts[big].tolist()]
    expected_bins = [float(e) for e in expected[big].tolist()]
    rest_expected = float(expected[~big].sum())
    if rest_expected > 0:
        observed_bins.append(float(counts[~big & (probs > 0)].sum()))
        expected_bins.append(rest_expected)
    if not tolerated or len(expected_bins) < 2:
        return SamplingFit(
            len(tokens),
            0.0 if tolerated else math.inf,
            max(len(expected_bins) - 1, 0),
            1.0 if tolerated else 0.0,
            outside,
            total_variation,
        )
    scale = sum(observed_bins) / sum(expected_bins)
    expected_bins = [e * scale for e in expected_bins]
    statistic, p_value = stats.chisquare(observed_bins, expected_bins)
    dof = len(expected_bins) - 1
    return SamplingFit(len(tokens), float(statistic), dof, float(p_value), outside, total_variation)
