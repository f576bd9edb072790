"""Curves of the benchmarks' results, one PNG each (``--plot FILE`` of the scripts here).

- ``serving``: generated tokens per second and time to first token (p50, p99) against the
  number of concurrent requests, one line per server (``serve.py``);
- ``refit``: seconds of a refit against the model's size, one line per backend and path, the
  plain memory copy of the same bytes as the floor (``refit.py``);
- ``batch_throughput``: generated tokens per second against rows per call, one line per
  generator (``hf_throughput.py``).

Each takes the rows its script already computes, so a script's ``--plot`` is one call at its
end. Needs matplotlib (in the workspace's dev environment).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["batch_throughput", "refit", "serving"]

GB = 1e9
MB = 1e6


def serving(points: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Throughput and time to first token against concurrency.

    Args:
        points: one per (server, concurrency): ``server``, ``concurrency``, ``tokens_s``,
            ``ttft_p50_s``, ``ttft_p99_s``.
        path: the PNG to write.
    """
    figure = _figure(2)
    throughput, ttft = figure.axes
    for index, (server, rows) in enumerate(_by(points, "server").items()):
        rows = sorted(rows, key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        color = f"C{index}"
        throughput.plot(xs, [r["tokens_s"] for r in rows], "o-", color=color, label=server)
        ttft.plot(xs, [r["ttft_p50_s"] for r in rows], "o-", color=color, label=f"{server} p50")
        ttft.plot(xs, [r["ttft_p99_s"] for r in rows], "s--", color=color, label=f"{server} p99")
    for ax in figure.axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        _integer_ticks(ax, [p["concurrency"] for p in points])
    throughput.set_ylabel("generated tokens / s")
    throughput.set_ylim(bottom=0)
    throughput.set_title("serving throughput", loc="left", fontsize=10)
    ttft.set_ylabel("time to first token, s")
    ttft.set_ylim(bottom=0)
    ttft.set_title("time to first token (p50 solid, p99 dashed)", loc="left", fontsize=10)
    return _save(figure, path, title)


def refit(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Refit seconds against model size, per backend and path, with the copy of the same bytes.

    Args:
        rows: ``refit.py``'s rows: ``model``, ``backend``, ``path``, ``seconds``, ``gb_s``,
            ``copy_gb_s`` (a model's bytes are ``seconds * gb_s``, the same on each of its rows).
        path: the PNG to write.
    """
    figure = _figure(1, width=9.0, height=5.0)
    ax = figure.axes[0]
    size_of = {r["model"]: r["seconds"] * r["gb_s"] * GB / MB for r in rows}  # MB
    copies: dict[str, float] = {}  # the fastest copy of each model's bytes, seconds
    for r in rows:
        seconds = size_of[r["model"]] * MB / GB / r["copy_gb_s"]
        copies[r["model"]] = min(copies.get(r["model"], seconds), seconds)
    series = _by(rows, "backend", "path")
    for index, ((backend, name), points) in enumerate(series.items()):
        sized = sorted((size_of[r["model"]], r["seconds"]) for r in points)
        ax.plot(
            [s for s, _ in sized],
            [t for _, t in sized],
            "-" if backend.startswith("gen-") else ":",
            color=f"C{index % 10}",
            marker="osD^v<>"[index // 10 % 7],
            label=f"{backend}: {name}",
        )
    models = sorted(copies, key=lambda m: size_of[m])
    sizes = [size_of[m] for m in models]
    ax.plot(
        sizes,
        [copies[m] for m in models],
        "k--",
        lw=2,
        label="plain copy of the same bytes (floor)",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(
        sizes,
        [
            f"{m}\n{size:.0f}" if size >= 10 else f"{m}\n{size:.3g}"
            for m, size in zip(models, sizes)
        ],
    )
    ax.xaxis.set_minor_formatter(_no_labels())
    _plain_numbers(ax.yaxis)
    ax.set_xlabel("model size, MB (float32)")
    ax.set_ylabel("seconds per refit (best repetition)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncols=2, loc="upper left")
    ax.set_title("refit time against model size, per backend and path", loc="left", fontsize=10)
    return _save(figure, path, title)


def batch_throughput(
    points: Sequence[Mapping[str, Any]], path: str | Path, title: str = ""
) -> Path:
    """Generated tokens per second against rows per call.

    Args:
        points: one per (generator, batch): ``generator``, ``batch``, ``tokens_s`` (fastest
            run), ``median_tokens_s``.
        path: the PNG to write.
    """
    figure = _figure(1, width=7.0, height=4.2)
    ax = figure.axes[0]
    for index, (generator, rows) in enumerate(_by(points, "generator").items()):
        rows = sorted(rows, key=lambda r: r["batch"])
        xs = [r["batch"] for r in rows]
        color = f"C{index}"
        ax.plot(xs, [r["tokens_s"] for r in rows], "o-", color=color, label=f"{generator}")
        ax.plot(
            xs,
            [r["median_tokens_s"] for r in rows],
            ":",
            color=color,
            label=f"{generator} (median run)",
        )
    ax.set_xscale("log", base=2)
    _integer_ticks(ax, [p["batch"] for p in points])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("rows per call")
    ax.set_ylabel("generated tokens / s (fastest run)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("generation throughput against batch size", loc="left", fontsize=10)
    return _save(figure, path, title)


# ---- helpers ------------------------------------------------------------------------------


def _figure(panels: int, width: float | None = None, height: float = 4.0) -> Any:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width or 6.0 * panels, height), layout="constrained")
    figure.subplots(1, panels, squeeze=False)
    return figure


def _save(figure: Any, path: str | Path, title: str) -> Path:
    if title:
        figure.suptitle(title, fontsize=11)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    return out


def _by(rows: Sequence[Mapping[str, Any]], *keys: str) -> dict[Any, list[Mapping[str, Any]]]:
    """Rows grouped by the value of ``keys`` (a tuple when several), in first-seen order."""
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for row in rows:
        key = tuple(row[k] for k in keys) if len(keys) > 1 else row[keys[0]]
        groups.setdefault(key, []).append(row)
    return groups


def _plain_numbers(axis: Any) -> None:
    """Tick labels of a log axis as plain numbers (0.01, 0.2), not powers of ten; between the
    powers of ten, 2 and 5 labelled too, and nothing more, so labels never crowd."""
    from matplotlib.ticker import FuncFormatter

    def minor(value: float, _: object) -> str:
        leading = f"{value:.0e}"[0]
        return f"{value:g}" if leading in "25" else ""

    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))


def _no_labels() -> Any:
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def _integer_ticks(ax: Any, values: Sequence[int]) -> None:
    ticks = sorted(set(values))
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.xaxis.set_minor_formatter(_no_labels())
