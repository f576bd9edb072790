"""The fleet's metrics (``fleet_*``, ``replica_<i>_*`` of ``get_logger_metrics()``) reach
``/metrics`` as ``gen:backend_<name>`` gauges, read at each scrape."""

from __future__ import annotations

import asyncio
from typing import Any

from fleet_backend import FleetNgram, client_of, ngram_app
from gen_backend_kit.fleet_health import ReplicaState
from prometheus_client.parser import text_string_to_metric_families


def scrape(backend: Any) -> dict[str, float]:
    """``/metrics``' ``gen:backend_*`` samples by name (their one label is the model's)."""

    async def ask() -> str:
        async with client_of(ngram_app(backend)) as client:
            answer = await client.get("/metrics")
        assert answer.status_code == 200
        return answer.text

    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(asyncio.run(ask())):
        for sample in family.samples:
            if sample.name.startswith("gen:backend_"):
                assert sample.labels == {"model_name": "ngram"}
                samples[sample.name] = sample.value
    return samples


def test_every_fleet_metric_reaches_prometheus_with_its_value() -> None:
    backend = FleetNgram(replicas=2, max_restarts=4)
    try:
        backend.fleet.kill(1, "its worker died")
        backend.fleet.move(1, ReplicaState.RESTARTING, "replacement starting")
        samples = scrape(backend)
        expected = {f"gen:backend_{k}": float(v) for k, v in backend.fleet.metrics().items()}
        assert {k: samples.get(k) for k in expected} == expected
        # the values the fleet's dashboards read, spelled out
        assert samples["gen:backend_fleet_replicas_serving"] == 1
        assert samples["gen:backend_fleet_replicas_restarting"] == 1
        assert samples["gen:backend_fleet_epoch"] == 1
        assert samples["gen:backend_fleet_restarts_total"] == 1
        assert samples["gen:backend_fleet_restarts_left"] == 3
        assert samples["gen:backend_replica_1_state"] == int(ReplicaState.RESTARTING)
        assert samples["gen:backend_replica_1_weight_version"] == -1
        assert samples["gen:backend_replica_0_weight_version"] == 0
        # beside the backend's own figures
        assert "gen:backend_rows_generated_total" in samples
    finally:
        backend.shutdown()


def test_each_scrape_reads_the_fleet_anew() -> None:
    backend = FleetNgram(replicas=2)
    try:
        assert scrape(backend)["gen:backend_fleet_replicas_dead"] == 0
        backend.fleet.kill(0, "it wedged")
        assert scrape(backend)["gen:backend_fleet_replicas_dead"] == 1
    finally:
        backend.shutdown()


class _OddMetrics(FleetNgram):
    def get_logger_metrics(self) -> dict[str, Any]:
        return {**super().get_logger_metrics(), "queue-depth.p99": 3, "note": "not a number"}


def test_names_prometheus_refuses_are_mended_and_values_that_are_not_numbers_left_out() -> None:
    backend = _OddMetrics()
    try:
        samples = scrape(backend)
        assert samples["gen:backend_queue_depth_p99"] == 3
        assert "gen:backend_note" not in samples
        assert samples["gen:backend_fleet_replicas_serving"] == 2  # the rest still there
    finally:
        backend.shutdown()
