"""``/health`` says the fleet's health: an empty 200 (vLLM's) while every replica serves or the
backend runs no fleet, 200 ``degraded`` while some replica is out, 503 ``unavailable`` while
none takes rows, 503 once the backend is unusable or its metrics do not come; the backend's
metrics are read off the event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from fleet_backend import FleetNgram, client_of, ngram_app, ngram_config
from gen_backend_kit.fleet_health import ReplicaState
from gen_testkit.ngram import NgramGeneration


def health(backend: Any, **settings: Any) -> tuple[int, bytes, Any]:
    """``/health``'s status, raw body, and JSON body (None when empty)."""

    async def ask() -> tuple[int, bytes, Any]:
        async with client_of(ngram_app(backend, **settings)) as client:
            answer = await client.get("/health")
        return answer.status_code, answer.content, answer.json() if answer.content else None

    return asyncio.run(ask())


def test_without_a_fleet_health_is_vllms_empty_200() -> None:
    backend = NgramGeneration(ngram_config())  # type: ignore[arg-type]
    try:
        assert health(backend)[:2] == (200, b"")
    finally:
        backend.shutdown()


def test_a_fleet_whose_replicas_all_serve_is_an_empty_200() -> None:
    backend = FleetNgram(replicas=3)
    try:
        assert health(backend)[:2] == (200, b"")
    finally:
        backend.shutdown()


def test_a_fleet_replacing_a_replica_is_degraded_with_its_counts() -> None:
    backend = FleetNgram(replicas=3, max_restarts=4)
    try:
        backend.fleet.kill(1, "its worker died")
        backend.fleet.move(1, ReplicaState.RESTARTING, "replacement starting")
        backend.fleet.kill(2, "it wedged")
        assert health(backend)[0::2] == (
            200,
            {
                "status": "degraded",
                "dead": 1,
                "restarting": 1,
                "serving": 1,
                "stale": 0,
                "suspect": 0,
                "replicas": 3,
                "epoch": 2,
                "restarts_left": 3,
            },
        )
    finally:
        backend.shutdown()


def test_a_fleet_of_suspects_still_takes_rows_so_it_is_degraded_not_unavailable() -> None:
    backend = FleetNgram(replicas=2)
    try:
        for replica in (0, 1):
            backend.fleet.move(replica, ReplicaState.SUSPECT, "silent for a while")
        status, _, body = health(backend)
        assert (status, body["status"], body["suspect"], body["serving"]) == (200, "degraded", 2, 0)
    finally:
        backend.shutdown()


def test_a_fleet_with_no_replica_taking_rows_is_503_unavailable() -> None:
    backend = FleetNgram(replicas=2, max_restarts=1)
    try:
        backend.fleet.kill(0, "its worker died")
        backend.fleet.kill(1, "its worker died")
        backend.fleet.move(0, ReplicaState.RESTARTING, "replacement starting")
        backend.fleet.move(0, ReplicaState.STALE, "engine up, weights not verified")
        status, _, body = health(backend)
        assert status == 503
        assert body == {
            "status": "unavailable",
            "dead": 1,
            "restarting": 0,
            "serving": 0,
            "stale": 1,
            "suspect": 0,
            "replicas": 2,
            "epoch": 2,
            "restarts_left": 0,
        }
    finally:
        backend.shutdown()


def test_a_backend_shut_down_is_503_unusable() -> None:
    backend = FleetNgram()
    backend.shutdown()
    status, _, body = health(backend)
    assert (status, body["status"], body["backend_state"]) == (503, "unusable", "shut down")


def test_metrics_that_do_not_come_in_time_make_health_503_and_leave_metrics_scrapable() -> None:
    backend = FleetNgram()
    backend.metrics_gate = threading.Event()  # never set while the server asks: the read hangs
    app = ngram_app(backend)
    app.state.server.metrics.read_timeout_s = 0.05

    async def ask() -> tuple[Any, Any]:
        async with client_of(app) as client:
            return await client.get("/health"), await client.get("/metrics")

    try:
        answer, scrape = asyncio.run(ask())
        assert answer.status_code == 503
        assert answer.json()["status"] == "unresponsive"
        assert "no answer within 0.05 s" in answer.json()["message"]
        assert scrape.status_code == 200 and "vllm:num_requests_running" in scrape.text
        assert "gen:backend_" not in scrape.text  # the backend's values are left out
    finally:
        backend.metrics_gate.set()
        app.state.server.metrics.close()
        backend.shutdown()


def test_health_reads_the_metrics_on_a_thread_while_the_loop_serves_other_requests() -> None:
    backend = FleetNgram()
    backend.metrics_gate = threading.Event()
    app = ngram_app(backend)

    async def ask() -> tuple[int, int, bool]:
        async with client_of(app) as client:
            pending = asyncio.ensure_future(client.get("/health"))
            async with asyncio.timeout(30):
                while not backend.metrics_threads:  # the read started and waits on the gate
                    await asyncio.sleep(0.01)
            models = await client.get("/v1/models")  # answered while the read waits
            waited = not pending.done()
            backend.metrics_gate.set()
            return models.status_code, (await pending).status_code, waited

    try:
        assert asyncio.run(ask()) == (200, 200, True)
        assert threading.main_thread().name not in backend.metrics_threads
        assert all(name.startswith("gen-serve-metrics") for name in backend.metrics_threads)
    finally:
        backend.metrics_gate.set()
        app.state.server.metrics.close()
        backend.shutdown()
