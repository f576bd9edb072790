"""Pictures of a parity run: per backend pair, four PNGs and one HTML page that holds them.

- ``differences``: how the teacher-forced logprob differences are spread (|d| on a log scale),
  against the tolerance, with the processed logprobs' distance from the exact distribution
  beside them against theirs;
- ``positions``: the differences along the generated positions (every token, and the largest
  per position), against the tolerance: a drift grows to the right;
- ``top-k``: per generated position, how many teacher-forced top-k lists were the same set, an
  edge tie or different;
- ``sampling``: per sampling prefix, each backend's counts of sampled first tokens beside the
  counts the exact distribution expects, with the chi-square p-values.

Needs matplotlib (``gen-testkit[plots]``).
"""

from __future__ import annotations

import html
import math
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from gen_testkit.parity.runner import SIGNIFICANCE, TOP_K, PairReport

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.container import BarContainer
    from matplotlib.figure import Figure

__all__ = ["write_plots"]

#: Tokens shown one by one in a sampling histogram; the rest of the support is pooled.
_SHOWN_TOKENS = 24
_COLORS = {"same": "#4c9a2a", "edge tie": "#e0a526", "differ": "#c0392b"}


def write_plots(reports: Sequence[PairReport], directory: str | Path) -> Path:
    """Write every pair's pictures and ``index.html`` into ``directory`` (made if missing).

    Returns:
        The HTML page's path.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'gen-testkit[plots]'``).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "gen-parity's pictures need matplotlib: install gen-testkit[plots] "
            "(`uv sync` in this workspace does)"
        ) from exc
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    for report in reports:
        stem = _slug(f"{report.reference}-vs-{report.candidate}-{report.dtype}")
        figures = {
            "differences": _differences(report),
            "positions": _positions(report),
            "top-k": _top_k(report),
            "sampling": _sampling(report),
        }
        files = {}
        for kind, figure in figures.items():
            if figure is None:
                continue
            name = f"{stem}-{kind}.png"
            figure.savefig(out / name, dpi=110)
            files[kind] = name
        sections.append(_section(report, files))
    page = out / "index.html"
    page.write_text(_PAGE.format(body="\n".join(sections)))
    return page


# ---- the four pictures ----------------------------------------------------------------------


def _differences(report: PairReport) -> Figure:
    tolerance = report.tolerance
    panels: list[tuple[str, list[float], float]] = [
        (
            f"teacher-forced raw logprobs, {report.reference} vs {report.candidate}",
            [abs(d) for _, d in report.trace.teacher_forced],
            tolerance.logprob_atol,
        )
    ]
    for name, points in report.trace.processed.items():
        panels.append(
            (
                f"{name}: processed logprobs vs the exact distribution",
                [abs(d) for _, d in points],
                tolerance.processed_logprob_atol,
            )
        )
    figure = _figure(len(panels), 1, height=2.6 * len(panels))
    for ax, (title, values, limit) in zip(figure.axes, panels):
        _log_histogram(ax, values, limit)
        ax.set_title(title, fontsize=10, loc="left")
    figure.axes[-1].set_xlabel("|difference| of log-probabilities (log scale)")
    figure.suptitle(_headline(report, "how far apart the logprobs are"), fontsize=11)
    return figure


def _positions(report: PairReport) -> Figure:
    figure = _figure(1, 1, height=3.4)
    ax = figure.axes[0]
    points = report.trace.teacher_forced
    drawn = [(x, abs(d)) for x, d in points if d != 0]
    if drawn:
        jitter = [((k * 0.618) % 1 - 0.5) * 0.5 for k in range(len(drawn))]
        ax.scatter(
            [x + j for (x, _), j in zip(drawn, jitter)],
            [y for _, y in drawn],
            s=6,
            alpha=0.35,
            color="#2c7fb8",
            lw=0,
        )
        worst: dict[int, float] = {}
        for x, y in drawn:
            worst[x] = max(worst.get(x, 0.0), y)
        order = sorted(worst)
        ax.plot(order, [worst[x] for x in order], color="#08306b", lw=1.5, label="largest")
    limit = report.tolerance.logprob_atol
    ax.axhline(limit, color=_COLORS["differ"], ls="--", lw=1.2, label="tolerance")
    ax.set_yscale("log")
    ax.set_ylim(top=max([limit, *(y for _, y in drawn)]) * 4)
    ax.set_xlabel("generated position (0: the first token after the prompt)")
    ax.set_ylabel("|difference|")
    ax.legend(loc="lower right", fontsize=8)
    zeros = len(points) - len(drawn)
    ax.set_title(
        f"teacher-forced raw logprobs along the rows: {len(points)} tokens"
        + (f", {zeros} exactly equal (not drawn)" if zeros else "")
        + "\nerrors that grew along a row would rise to the right",
        fontsize=9,
        loc="left",
    )
    figure.suptitle(_headline(report, "differences by position"), fontsize=11)
    return figure


def _top_k(report: PairReport) -> Figure:
    figure = _figure(1, 1, height=3.2)
    ax = figure.axes[0]
    counts: dict[str, Counter[int]] = {kind: Counter() for kind in _COLORS}
    for position, status in report.top_k.statuses:
        counts[status][position] += 1
    positions = sorted({p for p, _ in report.top_k.statuses})
    bottom = [0] * len(positions)
    for kind, color in _COLORS.items():
        heights = [counts[kind][p] for p in positions]
        total = sum(heights)
        ax.bar(positions, heights, bottom=bottom, color=color, label=f"{kind} ({total})")
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("generated position (greedy rows)")
    ax.set_ylabel("rows")
    ax.set_ylim(top=max(bottom, default=1) * 1.3)
    ax.legend(loc="upper center", ncols=3, fontsize=8)
    top = report.top_k
    ax.set_title(
        f"both backends' teacher-forced top-{TOP_K} lists at each position, as sets\n"
        f"largest difference of a logprob both list: {top.values.max_abs:.2g}; generated "
        f"tokens whose own top-{TOP_K} entry differs: {top.chosen_off} of {top.chosen_checked}",
        fontsize=9,
        loc="left",
    )
    figure.suptitle(_headline(report, f"top-{TOP_K} agreement"), fontsize=11)
    return figure


def _sampling(report: PairReport) -> Figure | None:
    prefixes = report.trace.sampling
    if not prefixes:
        return None
    names = list(prefixes[0].tokens)
    figure = _figure(len(prefixes), 1, height=3.0 * len(prefixes))
    width = 0.8 / (len(names) + 1)
    for k, (ax, trace) in enumerate(zip(figure.axes, prefixes)):
        expected = trace.expected
        support = sorted((t for t, p in enumerate(expected) if p > 0), key=lambda t: -expected[t])
        shown, rest = support[:_SHOWN_TOKENS], set(support[_SHOWN_TOKENS:])
        samples = len(next(iter(trace.tokens.values()), []))
        labels = [str(t) for t in shown] + (["rest"] if rest else [])
        xs = list(range(len(labels)))
        want = [expected[t] * samples for t in shown]
        if rest:
            want.append(sum(expected[t] for t in rest) * samples)
        ax.bar([x - 0.4 + width / 2 for x in xs], want, width, color="#bbbbbb", label="expected")
        for n, name in enumerate(names):
            seen = Counter(trace.tokens[name])
            got = [seen[t] for t in shown]
            if rest:
                got.append(sum(c for t, c in seen.items() if t in rest))
            outside = sum(c for t, c in seen.items() if expected[t] <= 0)
            ax.bar(
                [x - 0.4 + width * (n + 1.5) for x in xs],
                got,
                width,
                label=f"{name}: p = {trace.p_values[name]:.3f}"
                + (f", {outside} outside the support" if outside else ""),
            )
        ax.set_xticks(xs, labels, fontsize=7, rotation=90)
        ax.set_ylabel("samples")
        ax.legend(fontsize=8, loc="upper right")
        ax.set_title(
            f"prefix {k + 1}: {samples} sampled first tokens per backend, tokens by expected "
            f"count ({len(support)} in the support)",
            fontsize=9,
            loc="left",
        )
    figure.axes[-1].set_xlabel("token id")
    figure.suptitle(
        _headline(
            report, f"sampling against the exact distribution (fails below p = {SIGNIFICANCE:g})"
        ),
        fontsize=11,
    )
    return figure


# ---- helpers --------------------------------------------------------------------------------


def _figure(rows: int, columns: int, height: float) -> Figure:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9.0, height), layout="constrained")
    figure.subplots(rows, columns, squeeze=False)
    return figure


def _log_histogram(ax: Axes, values: list[float], limit: float) -> None:
    """|d| in log-spaced bins (red wholly beyond the tolerance), the tolerance as a dashed line,
    the largest value marked; exact zeros counted in the corner (a log axis has no 0)."""
    nonzero = [v for v in values if v > 0]
    zeros = len(values) - len(nonzero)
    low = math.floor(math.log10(min([*nonzero, limit])))
    high = math.ceil(math.log10(max([*nonzero, limit])))
    bins = [10 ** (low + i / 4) for i in range(4 * (high - low) + 1)]
    if nonzero:
        _, edges, patches = ax.hist(nonzero, bins=bins, color="#2c7fb8")
        bars = cast("BarContainer", patches)  # one data set: one bar per bin
        for left, patch in zip(edges, bars):
            if left >= limit:  # the whole bin beyond the tolerance
                patch.set_facecolor(_COLORS["differ"])
    ax.set_xscale("log")
    ax.set_xlim(10 ** (low - 0.25), 10 ** (math.log10(max([*nonzero, limit])) + 0.6))
    ax.axvline(limit, color=_COLORS["differ"], ls="--", lw=1.2)
    ax.text(
        limit,
        1.0,
        f" tolerance {limit:g}",
        transform=ax.get_xaxis_transform(),
        va="top",
        fontsize=8,
        color=_COLORS["differ"],
    )
    if nonzero:
        worst = max(nonzero)
        ax.axvline(worst, color="#08306b", lw=1.0)
        ax.text(
            worst,
            0.82,
            f" max {worst:.2g}",
            transform=ax.get_xaxis_transform(),
            va="top",
            fontsize=8,
            color="#08306b",
        )
    ax.set_ylabel("tokens")
    beyond = sum(v > limit for v in nonzero)
    note = (
        f"{len(values)} tokens"
        + (f", {zeros} exactly equal (not drawn)" if zeros else "")
        + (f", {beyond} beyond the tolerance" if beyond else "")
    )
    ax.text(0.005, 0.97, note, transform=ax.transAxes, va="top", fontsize=8)


def _headline(report: PairReport, what: str) -> str:
    verdict = "PASS" if report.ok else "FAIL"
    return f"{report.reference} vs {report.candidate} ({report.dtype}), {verdict}: {what}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def _section(report: PairReport, files: dict[str, str]) -> str:
    verdict = "PASS" if report.ok else "FAIL"
    failures = "".join(f"<li>{html.escape(f)}</li>" for f in report.failures)
    images = "".join(
        f'<figure><img src="{html.escape(name)}" alt="{html.escape(kind)}">'
        f"<figcaption>{_CAPTIONS[kind]}</figcaption></figure>"
        for kind, name in files.items()
    )
    tolerances = ", ".join(f"{k} {v:g}" for k, v in vars(report.tolerance).items() if v)
    return (
        f"<section><h2>{html.escape(report.reference)} vs {html.escape(report.candidate)} "
        f'({html.escape(report.dtype)}): <span class="{verdict.lower()}">{verdict}</span></h2>'
        f"<p>{report.rows} rows; tolerances: {html.escape(tolerances)}</p>"
        + (f"<ul>{failures}</ul>" if failures else "")
        + images
        + "</section>"
    )


_CAPTIONS: dict[str, str] = {
    "differences": "How far apart the two backends' logprobs of the same tokens are (each "
    "scores the other's rows too), and each backend's processed logprobs against the exact "
    "sampling distribution. Every bar must stay left of its dashed tolerance.",
    "positions": "The same teacher-forced differences by generated position: each dot a token, "
    "the line the largest per position. Errors that grew along a row would rise to the right.",
    "top-k": "Whether both backends list the same top-k tokens at each greedy position: the "
    "same set, an edge tie (a token at the k-th place within the near-tie margin) or different "
    "(a failure).",
    "sampling": "Many sampled first tokens after fixed prefixes: each backend's counts beside "
    "the counts the exact distribution expects (grey). The chi-square p-value fails below the "
    "significance level.",
}

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gen-parity</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1000px; margin: 2em auto; color: #222; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; border: 1px solid #ddd; }}
figcaption {{ color: #555; font-size: 0.9em; }}
.pass {{ color: #4c9a2a; }} .fail {{ color: #c0392b; }}
</style></head><body>
<h1>gen-parity</h1>
<p>Each pair: the first backend (the reference) against another on the same model and inputs.
The table printed by <code>gen-parity</code> holds the same numbers.</p>
{body}
</body></html>
"""
