"""The parity table printed by ``gen-parity``."""

from __future__ import annotations

from collections.abc import Sequence

from gen_testkit.parity.runner import PairReport

__all__ = ["format_table"]

_COLUMNS = (
    "pair",
    "dtype",
    "rows",
    "greedy agree / near-tie / differ",
    "teacher-forced max|d| mean|d| mean e^|d|",
    "top-5 same / edge tie / differ, max|d|, chosen off",
    "processed max|d| (ref, cand)",
    "sampling p-values (ref; cand)",
    "exact (ref, cand)",
    "routed experts same / near-tie / differ (ref; cand)",
    "vs float32 mean e^|d| (ref, cand)",
    "result",
)


def format_table(reports: Sequence[PairReport]) -> str:
    """A Markdown table, one row per backend pair."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for r in reports:
        names = (r.reference, r.candidate)
        tf, top = r.teacher_forced, r.top_k
        cells = [
            f"{r.reference} vs {r.candidate}",
            r.dtype,
            str(r.rows),
            f"{r.greedy.agree} / {r.greedy.near_ties} / {r.greedy.mismatches}",
            f"{tf.max_abs:.2e} {tf.mean_abs:.2e} {tf.mean_exp_abs:.7f}",
            f"{top.same} / {top.boundary_ties} / {top.mismatches}, {top.values.max_abs:.2e}, "
            f"{top.chosen_off} of {top.chosen_checked}",
            ", ".join(f"{r.processed[n].max_abs:.2e}" for n in names if n in r.processed),
            "; ".join(
                " ".join(f"{fit.p_value:.3f}" for fit in r.sampling.get(n, [])) for n in names
            ),
            ", ".join(_exact_cell(r, n) for n in names),
            "; ".join(_routing_cell(r, n) for n in names),
            ", ".join(
                f"{r.vs_float32[n].mean_exp_abs:.5f}" if n in r.vs_float32 else "n/a" for n in names
            ),
            "PASS" if r.ok else "FAIL",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _exact_cell(report: PairReport, name: str) -> str:
    """The share of greedy logprobs equal to the exact forward, ``*`` if batch-invariant."""
    agreement = report.exact.get(name)
    if agreement is None or not agreement.total:
        return "n/a"
    return f"{agreement.fraction:.3f}" + ("*" if name in report.batch_invariant else "")


def _routing_cell(report: PairReport, name: str) -> str:
    """(position, layer) routings equal to transformers', within router near-ties, and not."""
    routing = report.routing.get(name)
    if routing is None:
        return "n/a"
    return f"{routing.equal} / {routing.near_ties} / {len(routing.mismatches)}"
