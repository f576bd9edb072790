"""The Grafana dashboard of gen-serve's and the backends' Prometheus metrics, built with
grafana-foundation-sdk: ``dashboards/gen-serve.json`` is this file's output.

    uv run python tools/dashboard/build.py            # rewrites dashboards/gen-serve.json
    uv run python tools/dashboard/build.py --check    # exits 1 if the JSON is not this output

Rows: requests (vLLM's own names, which gen-serve exports unchanged, so panels of vLLM's
dashboards read it too), the backend's counters (``gen:backend_<name>``, the backend's
``get_logger_metrics()`` read at each scrape), weights and staleness, and the replicas
(gen-vllm's per-replica counters, one series per replica whatever their number). Every metric a
panel reads is one that ``gen-serve --backend vllm --replicas 2`` exports
(``tests/test_dashboard.py`` starts one and checks).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import VizLegendOptions
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, StackingMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "dashboards" / "gen-serve.json"

#: Every query reads the data source and servers the dashboard's variables pick.
_DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
_SELECT = 'model_name=~"$model", instance=~"$instance"'
_RATE = "$__rate_interval"


def _query(expr: str, legend: str, ref: str = "A") -> prometheus.Dataquery:
    return (
        prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(_DATASOURCE)
    )


def _series(
    title: str,
    description: str,
    queries: list[tuple[str, str]],
    unit: str,
    *,
    stacked: bool = False,
    width: int = 8,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(_DATASOURCE)
        .unit(unit)
        .height(8)
        .span(width)
        .fill_opacity(15 if stacked else 5)
        .line_width(2)
        .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST).show_legend(True))
    )
    if stacked:
        panel = panel.stacking(_stacking())
    for index, (expr, legend) in enumerate(queries):
        panel = panel.with_target(_query(expr, legend, chr(ord("A") + index)))
    return panel


def _stacking() -> Any:
    from grafana_foundation_sdk.builders.common import StackingConfig

    return StackingConfig().mode(StackingMode.NORMAL)


def _stat(title: str, description: str, expr: str, unit: str = "none") -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(_DATASOURCE)
        .unit(unit)
        .height(4)
        .span(4)
        .with_target(_query(expr, "{{instance}}"))
    )


def _quantiles(histogram: str) -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by (le) "
            f"(rate({histogram}_bucket{{{_SELECT}}}[{_RATE}])))",
            f"p{round(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    ]


def build() -> dashboard.Dashboard:
    """The dashboard, as the SDK's builder."""
    return (
        dashboard.Dashboard("gen-serve")
        .uid("gen-serve")
        .description(
            "gen-serve over any backend: requests (vLLM's metric names), the backend's own "
            "counters, weight updates and staleness, and gen-vllm's replicas."
        )
        .tags(["gen", "gen-serve", "vllm", "rl"])
        .refresh("10s")
        .time("now-30m", "now")
        .with_variable(
            dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(
            dashboard.QueryVariable("model")
            .label("Model")
            .datasource(_DATASOURCE)
            .query("label_values(gen:weight_version, model_name)")
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
        .with_variable(
            dashboard.QueryVariable("instance")
            .label("Server")
            .datasource(_DATASOURCE)
            .query('label_values(gen:weight_version{model_name=~"$model"}, instance)')
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
        # ---- at a glance -------------------------------------------------------------------
        .with_panel(
            _stat(
                "Weight version",
                "The committed weight version each server generates with (0: the checkpoint).",
                f"gen:weight_version{{{_SELECT}}}",
            )
        )
        .with_panel(
            _stat(
                "Requests running",
                "Requests being generated now.",
                f"sum(vllm:num_requests_running{{{_SELECT}}})",
            )
        )
        .with_panel(
            _stat(
                "Requests waiting",
                "Requests held while a weight update pauses the server.",
                f"sum(vllm:num_requests_waiting{{{_SELECT}}})",
            )
        )
        .with_panel(
            _stat(
                "Generated tokens / s",
                "Tokens generated per second, all servers.",
                f"sum(rate(vllm:generation_tokens_total{{{_SELECT}}}[{_RATE}]))",
            )
        )
        .with_panel(
            _stat(
                "Rows cut short / min",
                "Rows ended early by a weight update with in_flight=abort.",
                f"sum(rate(gen:backend_rows_cut_short_total{{{_SELECT}}}[{_RATE}])) * 60",
            )
        )
        .with_panel(
            _stat(
                "Admission rejections / min",
                "Requests refused with 503 because --max-requests were in flight.",
                f"sum(rate(vllm:admission_rejections_total{{{_SELECT}}}[{_RATE}])) * 60",
            )
        )
        # ---- requests ----------------------------------------------------------------------
        .with_row(dashboard.Row("Requests"))
        .with_panel(
            _series(
                "Tokens / s",
                "Prompt and generated tokens per second.",
                [
                    (
                        f"sum(rate(vllm:generation_tokens_total{{{_SELECT}}}[{_RATE}]))",
                        "generated",
                    ),
                    (f"sum(rate(vllm:prompt_tokens_total{{{_SELECT}}}[{_RATE}]))", "prompt"),
                ],
                "short",
            )
        )
        .with_panel(
            _series(
                "Time to first token",
                "From a request's arrival to its first token (quantiles over the window).",
                _quantiles("vllm:time_to_first_token_seconds"),
                "s",
            )
        )
        .with_panel(
            _series(
                "Request latency",
                "From a request's arrival to its last token.",
                _quantiles("vllm:e2e_request_latency_seconds"),
                "s",
            )
        )
        .with_panel(
            _series(
                "Finished rows by reason",
                "Rows finished per second: stop (a stop token or string), length "
                "(max_tokens or the context), abort (cut short by an update or a client).",
                [
                    (
                        "sum by (finished_reason) "
                        f"(rate(vllm:request_success_total{{{_SELECT}}}[{_RATE}]))",
                        "{{finished_reason}}",
                    )
                ],
                "short",
                stacked=True,
            )
        )
        .with_panel(
            _series(
                "Requests running and waiting",
                "Requests being generated, and those held while paused.",
                [
                    (f"sum(vllm:num_requests_running{{{_SELECT}}})", "running"),
                    (f"sum(vllm:num_requests_waiting{{{_SELECT}}})", "waiting"),
                ],
                "short",
            )
        )
        .with_panel(
            _series(
                "Rows in the backend",
                "Rows of calls in progress in the backend, now and the most at once since "
                "the backend's metrics were last cleared.",
                [
                    (f"sum(gen:backend_rows_running{{{_SELECT}}})", "running"),
                    (f"max(gen:backend_rows_running_peak{{{_SELECT}}})", "peak"),
                ],
                "short",
            )
        )
        # ---- the backend -------------------------------------------------------------------
        .with_row(dashboard.Row("Backend"))
        .with_panel(
            _series(
                "Row time",
                "From a call's start to each row's end (mean and p99 of the latest rows), and "
                "to each streamed row's first token.",
                [
                    (f"gen:backend_row_seconds_mean{{{_SELECT}}}", "row mean {{instance}}"),
                    (f"gen:backend_row_seconds_p99{{{_SELECT}}}", "row p99 {{instance}}"),
                    (
                        f"gen:backend_time_to_first_token_seconds_p99{{{_SELECT}}}",
                        "first token p99 {{instance}}",
                    ),
                ],
                "s",
            )
        )
        .with_panel(
            _series(
                "Backend tokens / s",
                "Tokens returned over the seconds rows ran, as the backend counts them.",
                [(f"gen:backend_tokens_per_second{{{_SELECT}}}", "{{instance}}")],
                "short",
            )
        )
        .with_panel(
            _series(
                "Rows by outcome",
                "Rows returned per second, and those that stopped for length or were cut "
                "short by an update.",
                [
                    (
                        f"sum(rate(gen:backend_rows_generated_total{{{_SELECT}}}[{_RATE}]))",
                        "returned",
                    ),
                    (
                        f"sum(rate(gen:backend_rows_truncated_total{{{_SELECT}}}[{_RATE}]))",
                        "length",
                    ),
                    (
                        f"sum(rate(gen:backend_rows_cut_short_total{{{_SELECT}}}[{_RATE}]))",
                        "cut short",
                    ),
                ],
                "short",
            )
        )
        # ---- weights and staleness ---------------------------------------------------------
        .with_row(dashboard.Row("Weights and staleness"))
        .with_panel(
            _series(
                "Weight update time",
                "Start to commit (or abort) of each update, as gen-serve saw it, and the mean "
                "and longest refit the backend counted.",
                [
                    *_quantiles("gen:weight_update_duration_seconds")[::2],
                    (f"gen:backend_refit_seconds_mean{{{_SELECT}}}", "backend mean"),
                    (f"gen:backend_refit_seconds_max{{{_SELECT}}}", "backend max"),
                ],
                "s",
            )
        )
        .with_panel(
            _series(
                "Refit time by phase",
                "Seconds per second spent in each phase of committed updates: begin (pausing "
                "the engines), load (inside loads), commit (verifying and resuming).",
                [
                    (
                        f"sum(rate(gen:backend_refit_{phase}_seconds_total{{{_SELECT}}}[{_RATE}]))",
                        phase,
                    )
                    for phase in ("begin", "load", "commit")
                ],
                "s",
                stacked=True,
            )
        )
        .with_panel(
            _series(
                "Refit bandwidth",
                "Bytes of weights committed updates carried, per second.",
                [
                    (
                        f"sum(rate(gen:backend_refit_bytes_total{{{_SELECT}}}[{_RATE}]))",
                        "bytes",
                    ),
                ],
                "Bps",
            )
        )
        .with_panel(
            _series(
                "Tokens by staleness",
                "Generated tokens per second by how many versions their weights were behind "
                "the newest announced when their row ended (0: current).",
                [
                    (
                        "sum by (__name__) (rate({__name__=~"
                        '"gen:backend_tokens_versions_behind_[0-9]+_total", '
                        f"{_SELECT}}}[{_RATE}]))",
                        "{{__name__}}",
                    )
                ],
                "short",
                stacked=True,
            )
        )
        .with_panel(
            _series(
                "Staleness bound",
                "Rows refused by max_weight_staleness, and rows that waited for an update to "
                "start under it, per second.",
                [
                    (
                        f"sum(rate(gen:backend_rows_refused_stale_total{{{_SELECT}}}[{_RATE}]))",
                        "refused",
                    ),
                    (
                        f"sum(rate(gen:backend_rows_waited_stale_total{{{_SELECT}}}[{_RATE}]))",
                        "waited",
                    ),
                ],
                "short",
            )
        )
        .with_panel(
            _series(
                "Committed updates",
                "Weight updates committed in each interval.",
                [
                    (
                        f"sum(increase(gen:backend_refits_total{{{_SELECT}}}[{_RATE}]))",
                        "refits",
                    )
                ],
                "short",
            )
        )
        # ---- gen-vllm's replicas -----------------------------------------------------------
        .with_row(dashboard.Row("Replicas (gen-vllm)"))
        .with_panel(
            _series(
                "Tokens / s by replica",
                "Generated tokens per second of each data-parallel replica (one series per "
                "replica, whatever their number): an idle or slow replica shows here.",
                [
                    (
                        "sum by (__name__) (rate({__name__=~"
                        '"gen:backend_replica_[0-9]+_tokens_generated_total", '
                        f"{_SELECT}}}[{_RATE}]))",
                        "{{__name__}}",
                    )
                ],
                "short",
                stacked=True,
                width=12,
            )
        )
        .with_panel(
            _series(
                "Prefix cache hit rate",
                "Prompt tokens of generated rows that vLLM's prefix caches held.",
                [
                    (
                        f"sum(rate(gen:backend_prefix_cache_hits_total{{{_SELECT}}}[{_RATE}]))"
                        " / sum(rate(gen:backend_prefix_cache_queries_total"
                        f"{{{_SELECT}}}[{_RATE}]))",
                        "hit rate",
                    )
                ],
                "percentunit",
                width=12,
            )
        )
    )


def render() -> str:
    """The dashboard as Grafana's JSON model, as committed."""
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the committed JSON")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is not what {__file__} builds: run it", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
