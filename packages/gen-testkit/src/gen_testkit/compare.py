"""Row-by-row comparison of two generation outputs, with near-ties told apart from mismatches."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = ["ComparisonReport", "RowComparison", "compare_generations", "generated_rows"]

RowStatus = Literal["equal", "near_tie", "mismatch"]


@dataclass(frozen=True)
class RowComparison:
    """How one row of two outputs compares.

    Attributes:
        status: ``equal`` (same tokens, logprobs within tolerance), ``near_tie`` (tokens diverge
            where the two emitted tokens' logprobs are within the near-tie margin; the rest of the
            row is not compared), or ``mismatch``.
        diverged_at: index of the first generated token that differs, or None.
        max_logprob_diff: largest |difference| over the compared positions.
        detail: a sentence for failure messages.
    """

    row: int
    status: RowStatus
    diverged_at: int | None
    max_logprob_diff: float
    detail: str


@dataclass
class ComparisonReport:
    """The comparison of every row; ``ok`` when no row is a mismatch."""

    rows: list[RowComparison] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def mismatches(self) -> list[RowComparison]:
        return [r for r in self.rows if r.status == "mismatch"]

    @property
    def near_ties(self) -> list[RowComparison]:
        return [r for r in self.rows if r.status == "near_tie"]

    @property
    def max_logprob_diff(self) -> float:
        return max((r.max_logprob_diff for r in self.rows), default=0.0)

    def assert_ok(self, what: str = "outputs") -> None:
        """Raise ``AssertionError`` naming the first mismatching rows."""
        if not self.ok:
            lines = "\n".join(f"  row {r.row}: {r.detail}" for r in self.mismatches[:5])
            raise AssertionError(
                f"{what} differ in {len(self.mismatches)} of {len(self.rows)} rows:\n{lines}"
            )


def generated_rows(output: Mapping[str, Any]) -> list[tuple[list[int], list[float]]]:
    """Each row's generated token ids and their logprobs, cut from the output layout."""
    rows = []
    for i in range(output["output_ids"].shape[0]):
        end = int(output["unpadded_sequence_lengths"][i])
        start = end - int(output["generation_lengths"][i])
        rows.append(
            (
                output["output_ids"][i, start:end].tolist(),
                output["logprobs"][i, start:end].tolist(),
            )
        )
    return rows


def compare_generations(
    expected: Mapping[str, Any],
    actual: Mapping[str, Any],
    *,
    logprob_atol: float,
    near_tie: float,
) -> ComparisonReport:
    """Compare two outputs of the same inputs, row by row.

    Where the tokens diverge at generated position j, the divergence is a near-tie when the two
    outputs' logprobs at j differ by at most ``near_tie``: in greedy decoding each output reports
    the log-probability of its own argmax, so two honest decoders that split a near-tie report
    nearly equal values, while a decoder that picked a clearly worse token reports a lower one.

    Args:
        expected, actual: ``GenerationOutputSpec`` batches of the same inputs.
        logprob_atol: largest allowed |difference| of logprobs at positions both agree on.
        near_tie: the near-tie margin, in log-probability units.
    """
    report = ComparisonReport()
    left, right = generated_rows(expected), generated_rows(actual)
    if len(left) != len(right):
        raise AssertionError(f"outputs hold {len(left)} and {len(right)} rows")
    for i, ((tok_a, lp_a), (tok_b, lp_b)) in enumerate(zip(left, right)):
        common = min(len(tok_a), len(tok_b))
        diverged = next((j for j in range(common) if tok_a[j] != tok_b[j]), None)
        upto = common if diverged is None else diverged
        diffs = (torch.tensor(lp_a[:upto]) - torch.tensor(lp_b[:upto])).abs()
        worst = float(diffs.max()) if upto else 0.0
        if worst > logprob_atol:
            j = int(diffs.argmax())
            report.rows.append(
                RowComparison(
                    i,
                    "mismatch",
                    diverged,
                    worst,
                    f"logprob of token {j} ({tok_a[j]}) is {lp_a[j]:.7g} vs {lp_b[j]:.7g}, "
                    f"|diff| {worst:.3g} > {logprob_atol:g}",
                )
            )
        elif diverged is None and len(tok_a) == len(tok_b):
            report.rows.append(RowComparison(i, "equal", None, worst, "equal"))
        elif diverged is None:
            report.rows.append(
                RowComparison(
                    i,
                    "mismatch",
                    common,
                    worst,
                    f"same first {common} tokens, then one output stops: lengths "
                    f"{len(tok_a)} vs {len(tok_b)}",
                )
            )
        else:
            assert diverged is not None
            gap = abs(lp_a[diverged] - lp_b[diverged])
            status: RowStatus = "near_tie" if gap <= near_tie else "mismatch"
            report.rows.append(
                RowComparison(
                    i,
                    status,
                    diverged,
                    worst,
                    f"token {diverged} is {tok_a[diverged]} (logprob {lp_a[diverged]:.7g}) vs "
                    f"{tok_b[diverged]} (logprob {lp_b[diverged]:.7g}); gap {gap:.3g} "
                    f"{'<=' if status == 'near_tie' else '>'} near-tie margin {near_tie:g}",
                )
            )
    return report
