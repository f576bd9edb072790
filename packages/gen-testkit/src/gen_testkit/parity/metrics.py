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
    "ExactAgreement",
    "GreedyAgreement",
    "LogprobError",
    "SamplingFit",
    "TopKAgreement",
    "chi_square_fit",
    "chosen_matches_top_k",
    "exact_agreement",
    "greedy_agreement",
    "logprob_error",
    "score_outputs",
    "score_top_k",
    "top_k_agreement",
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
class ExactAgreement:
    """How many generated tokens' reported logprobs equal the trainer's exact forward bitwise
    (``gen_hf.exact.sequence_logprobs``): 1.0 for a backend in batch-invariant mode."""

    equal: int = 0
    total: int = 0

    @property
    def fraction(self) -> float:
        return self.equal / self.total if self.total else math.nan

    def add(self, other: ExactAgreement) -> None:
        self.equal += other.equal
        self.total += other.total


@dataclass
class TopKAgreement:
    """Two backends' top-k lists at the same positions, and each output's chosen tokens.

    At a position the two lists hold the same set of k tokens (``same``), or differ only by
    tokens at the k-th place's edge (``boundary_ties``: every token one backend lists and the
    other does not is within ``near_tie`` of the other's k-th logprob, as greedy near-ties are
    counted), or differ (``mismatches``). ``values`` compares the logprobs of the tokens both
    list. ``chosen_off`` counts generated tokens that are in their own top-k list with another
    logprob than their entry there (they must be equal).
    """

    positions: int = 0
    same: int = 0
    boundary_ties: int = 0
    mismatches: int = 0
    values: LogprobError = field(default_factory=LogprobError)
    chosen_checked: int = 0
    chosen_off: int = 0
    details: list[str] = field(default_factory=list)
    #: each compared position's generated index (0: first after the prompt) and verdict:
    #: "same", "edge tie" or "differ"
    statuses: list[tuple[int, str]] = field(default_factory=list)

    def add(self, other: TopKAgreement) -> None:
        self.positions += other.positions
        self.same += other.same
        self.boundary_ties += other.boundary_ties
        self.mismatches += other.mismatches
        self.values.add(other.values)
        self.chosen_checked += other.chosen_checked
        self.chosen_off += other.chosen_off
        self.details += other.details
        self.statuses += other.statuses


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


def top_k_agreement(
    first: Mapping[str, Any],
    second: Mapping[str, Any],
    output: Mapping[str, Any],
    prompt_lengths: Sequence[int],
    k: int,
    near_tie: float,
) -> TopKAgreement:
    """Compare two ``score_top_logprobs(.., k + 1)`` results of ``output``'s rows over its
    generated positions: the first k entries as sets, the (k+1)-th only to judge edge ties."""
    result = TopKAgreement()
    mask = _generated_mask(output, prompt_lengths)
    for i, j in mask.nonzero().tolist():
        a = dict(zip(first["topk_ids"][i, j].tolist(), first["topk_logprobs"][i, j].tolist()))
        b = dict(zip(second["topk_ids"][i, j].tolist(), second["topk_logprobs"][i, j].tolist()))
        top_a, top_b = list(a)[:k], list(b)[:k]
        edge_a, edge_b = a[top_a[-1]], b[top_b[-1]]  # each one's k-th logprob
        result.positions += 1
        both = [t for t in top_a if t in top_b]
        result.values.add_values(
            torch.tensor([a[t] for t in both]), torch.tensor([b[t] for t in both])
        )
        only_a = [t for t in top_a if t not in top_b]
        only_b = [t for t in top_b if t not in top_a]
        position = j - prompt_lengths[i]
        if not only_a:
            result.same += 1
            result.statuses.append((position, "same"))
        elif all(a[t] <= edge_b + near_tie for t in only_a) and all(
            b[t] <= edge_a + near_tie for t in only_b
        ):
            result.boundary_ties += 1
            result.statuses.append((position, "edge tie"))
        else:
            result.mismatches += 1
            result.statuses.append((position, "differ"))
            result.details.append(
                f"row {i} position {j}: top-{k} differ by {only_a} vs {only_b} beyond the "
                f"k-th place's near-tie margin {near_tie:g}"
            )
    return result


def chosen_matches_top_k(output: Mapping[str, Any], prompt_lengths: Sequence[int]) -> TopKAgreement:
    """Over ``output``'s generated positions: each chosen token found in its own top-k list,
    and whether its logprob equals its entry there."""
    result = TopKAgreement()
    mask = _generated_mask(output, prompt_lengths)
    tokens, logprobs = output["output_ids"][mask], output["logprobs"][mask]
    ids, values = output["topk_ids"][mask], output["topk_logprobs"][mask]
    hit = ids == tokens[:, None]
    found = hit.any(dim=1)
    result.chosen_checked = int(found.sum())
    entry = torch.where(hit, values, torch.zeros_like(values)).sum(dim=1)
    result.chosen_off = int((found & (entry != logprobs)).sum())
    return result


def score_top_k(
    scorer: GenerationInterface, output: Mapping[str, Any], prompt_lengths: Sequence[int], k: int
) -> BatchedDataDict[Any]:
    """``scorer``'s teacher-forced top-``k`` lists of another backend's output rows."""
    return scorer.score_top_logprobs(
        BatchedDataDict(
            input_ids=output["output_ids"],
            prompt_lengths=torch.tensor(list(prompt_lengths), dtype=torch.int64),
            unpadded_sequence_lengths=output["unpadded_sequence_lengths"],
        ),
        k,
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


def exact_agreement(
    output: Mapping[str, Any], prompt_lengths: Sequence[int], exact: Sequence[torch.Tensor]
) -> ExactAgreement:
    """Compare an output's reported raw logprobs with ``exact[i]`` ``[T_i]``, the trainer-side
    exact logprobs of row i's whole sequence, at the generated positions."""
    agreement = ExactAgreement()
    for i, start in enumerate(prompt_lengths):
        end = int(output["unpadded_sequence_lengths"][i])
        reported = output["logprobs"][i, start:end]
        agreement.equal += int((reported == exact[i][start:end]).sum())
        agreement.total += end - start
    return agreement
