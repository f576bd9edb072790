"""The Grafana dashboard (``dashboards/gen-serve.json``): it is what ``tools/dashboard/build.py``
builds with grafana-foundation-sdk, it reads back through the SDK's types unchanged, and every
metric its panels query is one that ``gen-serve --backend vllm --replicas 2`` exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("grafana_foundation_sdk")

from dashboard import build

_NAME_MATCHER = re.compile(r'__name__=~"(?P<regex>[^"]+)"')
_METRIC = re.compile(r"[A-Za-z_][A-Za-z0-9_]*:[A-Za-z0-9_:]*")


def _committed() -> dict[str, Any]:
    return json.loads(build.OUTPUT.read_text())


def _queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield f"variable {variable['name']}", variable["query"]


def metric_names(expr: str) -> tuple[set[str], set[str]]:
    """The metric names a PromQL expression reads, and the ``__name__=~`` patterns it matches
    names with (every metric of this project has a ``:`` in its name; functions, labels and
    variables have none)."""
    patterns = {m.group("regex") for m in _NAME_MATCHER.finditer(expr)}
    bare = re.sub(r'"[^"]*"', "", expr)  # label values and patterns
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", bare)  # matchers and ranges
    return set(_METRIC.findall(bare)), patterns


def test_metric_names_are_read_from_promql():
    names, patterns = metric_names(
        'sum by (__name__) (rate({__name__=~"gen:backend_replica_[0-9]+_total", '
        'model_name=~"$model"}[$__rate_interval])) / rate(vllm:prompt_tokens_total{a="b:c"}[1m])'
    )
    assert names == {"vllm:prompt_tokens_total"}
    assert patterns == {"gen:backend_replica_[0-9]+_total"}


def test_the_committed_json_is_what_the_builder_builds():
    assert build.main(["--check"]) == 0, "run `uv run python tools/dashboard/build.py`"


def test_the_json_reads_back_through_the_sdk_types_unchanged():
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    committed = _committed()
    model = Dashboard.from_json(committed)
    assert json.loads(json.dumps(model, cls=JSONEncoder)) == committed
    queried = [p for p in committed["panels"] if p.get("targets")]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in queried)


@pytest.fixture(scope="module")
def exported(tiny_qwen2: Any) -> Iterator[set[str]]:
    """The sample names ``gen-serve --backend vllm --replicas 2`` exports once it has served a
    request, streamed one and taken a weight update (gen-remote's refit over its routes)."""
    pytest.importorskip("vllm")
    import httpx
    from gen_interface import create_generation_backend
    from gen_interface.weights import Refitter
    from gen_testkit.servers import ServerProcess, free_port, gen_serve_command

    port = free_port()
    command = gen_serve_command(
        "vllm", tiny_qwen2.path, port, served_model_name="tiny", extra=["--replicas", "2"]
    )
    server = ServerProcess(
        command, port, env={"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}, name="gen-serve-x2"
    )
    try:
        server.wait_ready(600)
        body = {"model": "tiny", "prompt": [5, 17, 42], "max_tokens": 4, "n": 4}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).is_success
        body = {**body, "n": 1, "stream": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).is_success
        remote = create_generation_backend(
            {"backend": "remote", "remote_cfg": {"base_url": server.url}}
        )
        try:
            with Refitter(remote) as refitter:
                refitter.refit(tiny_qwen2.state_dict())
        finally:
            remote.shutdown()
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
    finally:
        server.stop()
    yield {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1].isalpha()}


def test_every_panel_reads_metrics_that_two_replicas_export(exported: set[str]):
    problems = []
    for title, expr in _queries(_committed()):
        names, patterns = metric_names(expr)
        assert names or patterns, f"{title}: no metric name found in {expr!r}"
        problems += [f"{title}: {name} is not exported" for name in names - exported]
        for pattern in patterns:
            matched = {n for n in exported if re.fullmatch(pattern, n)}
            if not matched:
                problems.append(f"{title}: nothing exported matches {pattern}")
            if "replica" in pattern and len(matched) != 2:
                problems.append(f"{title}: {pattern} matches {sorted(matched)}, not 2 replicas")
    assert not problems, "\n".join(problems) + f"\nexported: {sorted(exported)}"
