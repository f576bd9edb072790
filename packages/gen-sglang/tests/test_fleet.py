"""The fleet's state logic on stand-in servers (no SGLang): losses, replacements, what they
load, when they are admitted, what the metrics say, and how rows move in ``RowRouter``. One
real-server check is in ``test_healing.py``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from gen_backend_kit.fleet_health import FleetHealth, ReplicaState
from gen_interface import BackendBrokenError, NoReplicaServingError, RowLostError
from gen_sglang.fleet import ServerFleet, ServerLostError
from gen_sglang.routing import RowRouter


class StandIn:
    """A server: ``weights`` is what it holds (its checksum), ``gone`` makes it dead."""

    def __init__(
        self, name: str, weights: str = "checkpoint", ready: threading.Event | None = None
    ):
        self.name = name
        self.weights = weights
        self.gone = False
        self.stopped = False
        self._ready = ready

    def wait_ready(self, timeout_s: float) -> None:
        if self._ready is not None and not self._ready.wait(timeout_s):
            raise TimeoutError(f"{self.name} did not start")
        if self.stopped:
            raise RuntimeError(f"{self.name} was stopped while it started")

    def died(self) -> str | None:
        return f"{self.name} exited" if self.gone else None

    def stop(self) -> None:
        self.stopped = True
        if self._ready is not None:
            self._ready.set()


class Harness:
    """A fleet of stand-ins. ``staged`` is what the staged checkpoint holds; replacements
    start holding ``fresh`` (the checkpoint, unless a test says otherwise)."""

    def __init__(self, size: int = 2, *, healing: bool = True, max_restarts: int = 4, **kw: Any):
        self.servers = [StandIn(f"replica {i}") for i in range(size)]
        self.launched: list[StandIn] = []
        self.loads: list[tuple[str, int]] = []
        self.staged = "checkpoint"
        self.fresh = "checkpoint"
        self.ready: threading.Event | None = None
        self.fleet: ServerFleet[StandIn] = ServerFleet(
            self.servers,
            FleetHealth(size, max_restarts=max_restarts),
            healing=healing,
            launch=self.launch,
            start_timeout_s=10.0,
            load=self.load,
            checksum=lambda server: server.weights,
            **kw,
        )

    def launch(self, replica: int) -> StandIn:
        server = StandIn(f"replica {replica}", self.fresh, self.ready)
        self.launched.append(server)
        return server

    def load(self, server: StandIn, version: int) -> None:
        self.loads.append((server.name, version))
        server.weights = self.staged

    def commit(self, version: int, weights: str) -> None:
        """An update that writes ``weights`` and commits on every member."""
        for replica in self.fleet.begin_update():
            self.fleet.servers[replica].weights = weights
        self.fleet.staged_written()
        self.staged = weights
        self.fleet.committed(version)
        self.fleet.update_ended()

    def kill(self, replica: int) -> StandIn:
        server = self.fleet.servers[replica]
        server.gone = True
        assert self.fleet.lose(replica, server, f"{server.name} exited")
        return server


@pytest.fixture
def harness() -> Any:
    made: list[Harness] = []

    def make(*args: Any, **kw: Any) -> Harness:
        made.append(Harness(*args, **kw))
        return made[-1]

    yield make
    for h in made:
        h.fleet.close()


def _until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the fleet did not get there"
        time.sleep(0.01)


def test_a_lost_server_is_replaced_from_the_checkpoint_before_any_commit(harness):
    h = harness()
    dead = h.kill(1)
    assert dead.stopped or _until(lambda: dead.stopped) is None
    assert h.fleet.wait_settled(10.0)
    metrics = h.fleet.metrics()
    assert h.fleet.servers[1] is h.launched[0] and h.loads == []  # it holds the checkpoint
    assert metrics["replica_1_state"] == ReplicaState.SERVING
    assert metrics["replica_1_weight_version"] == 0
    assert metrics["fleet_restarts_total"] == 1 and metrics["fleet_faults_total"] == 1
    assert metrics["fleet_epoch"] == 2  # left, then admitted
    assert metrics["fleet_replicas_serving"] == 2


def test_after_a_commit_the_replacement_loads_the_staged_copy_and_serves_at_its_version(harness):
    h = harness()
    h.commit(3, "v3")
    h.kill(0)
    assert h.fleet.wait_settled(10.0)
    assert h.loads == [("replica 0", 3)]
    metrics = h.fleet.metrics()
    assert metrics["replica_0_state"] == ReplicaState.SERVING
    assert metrics["replica_0_weight_version"] == 3 and metrics["replica_1_weight_version"] == 3


def test_a_replacement_whose_checksum_differs_is_not_admitted_and_another_follows(
    harness, caplog: pytest.LogCaptureFixture
):
    h = harness(max_restarts=2)
    h.commit(1, "v1")
    h.staged = "damaged"
    with caplog.at_level(logging.WARNING, logger="gen_sglang.fleet"):
        h.kill(0)
        _until(lambda: h.fleet.health.restarts_left == 0 and h.fleet.settled())
    assert h.fleet.health.state(0) is ReplicaState.DEAD
    assert len(h.launched) == 2 and all(s.stopped for s in h.launched)
    assert "does not hold the weights replica 1 serves" in caplog.text
    assert "used its 2 replica restarts" in caplog.text
    assert h.fleet.members() == [1]


def test_a_replacement_waits_for_an_open_update_then_loads_its_result(harness):
    h = harness()
    h.commit(1, "v1")
    h.ready = threading.Event()
    h.kill(0)
    members = h.fleet.begin_update()  # an update opens while the replacement starts
    assert members == [1]
    h.ready.set()
    _until(lambda: h.fleet.health.state(0) is ReplicaState.STALE)
    time.sleep(0.2)
    assert h.fleet.health.state(0) is ReplicaState.STALE and h.loads == []
    h.fleet.servers[1].weights = h.staged = "v2"
    h.fleet.committed(2)
    h.fleet.update_ended()
    assert h.fleet.wait_settled(10.0)
    assert h.loads == [("replica 0", 2)]
    assert h.fleet.metrics()["replica_0_weight_version"] == 2


def test_a_dropped_update_that_wrote_the_staged_copy_holds_replacements_until_a_commit(harness):
    h = harness()
    h.commit(1, "v1")
    h.fleet.begin_update()
    h.fleet.staged_written()
    h.staged = "half of v2"
    h.fleet.update_ended()  # dropped: the servers keep v1, the copy does not
    h.kill(0)
    _until(lambda: h.fleet.health.state(0) is ReplicaState.STALE)
    time.sleep(0.2)
    assert h.fleet.health.state(0) is ReplicaState.STALE and h.loads == []
    h.commit(2, "v2")
    assert h.fleet.wait_settled(10.0)
    assert h.loads == [("replica 0", 2)]
    assert h.fleet.health.state(0) is ReplicaState.SERVING


def test_with_no_peer_serving_the_first_replacement_is_admitted_on_its_source(harness):
    h = harness()
    h.commit(1, "v1")
    h.kill(0)
    h.kill(1)
    assert h.fleet.wait_settled(10.0)
    assert h.fleet.members() == [0, 1]
    assert sorted(h.loads) == [("replica 0", 1), ("replica 1", 1)]
    assert h.fleet.no_replica_serving().retryable


def test_a_loss_is_reported_once_and_not_for_a_server_replaced_since(harness):
    h = harness()
    dead = h.kill(0)
    assert not h.fleet.lose(0, dead, "reported again")
    assert h.fleet.wait_settled(10.0)
    assert not h.fleet.lose(0, dead, "the old server's connection failing late")
    assert h.fleet.health.state(0) is ReplicaState.SERVING and h.fleet.faults == 1


def test_the_watch_thread_finds_a_dead_process_without_a_request(harness):
    h = harness()
    h.ready = threading.Event()  # the replacement does not come up: the loss stays visible
    h.fleet.servers[1].gone = True
    _until(lambda: h.fleet.health.state(1) is not ReplicaState.SERVING, timeout_s=5.0)
    assert h.fleet.faults == 1 and h.fleet.members() == [0]


def test_a_server_whose_streams_all_go_silent_past_the_bound_is_wedged_stopped_and_lost(
    harness, caplog
):
    caplog.set_level(logging.WARNING, logger="gen_sglang.fleet")
    h = harness(wedge_timeout_s=1.0)
    h.ready = threading.Event()  # the replacement does not come up: the loss stays visible
    quiet, busy = h.fleet.servers
    with h.fleet.streaming(quiet), h.fleet.streaming(busy) as progress:
        deadline = time.monotonic() + 10.0
        while h.fleet.health.state(0) is ReplicaState.SERVING:
            assert time.monotonic() < deadline, "the silent server was not found wedged"
            progress()  # the other server keeps sending
            time.sleep(0.02)
        assert quiet.stopped or _until(lambda: quiet.stopped) is None  # killed, not left
        assert any("replica 0 is dead: wedged" in r.getMessage() for r in caplog.records)
    assert h.fleet.health.state(1) is ReplicaState.SERVING and not busy.stopped
    assert h.fleet.faults == 1


def test_an_idle_server_or_one_held_by_an_update_is_never_wedged(harness):
    h = harness(wedge_timeout_s=1.0)
    time.sleep(2.2)  # no request streams: silence is not a wedge (the watch looks 4 times)
    assert h.fleet.faults == 0
    members = h.fleet.begin_update()
    with h.fleet.streaming(h.fleet.servers[0]):
        time.sleep(2.2)  # an update holds generation: no bytes, and no wedge
        assert h.fleet.members() == members == [0, 1]
        h.fleet.update_ended()  # the bound counts from the update's end, not the stream's start
        assert h.fleet._wedged() == []
    assert h.fleet.faults == 0 and h.fleet.members() == [0, 1]


def test_close_stops_a_replacement_that_is_starting(harness):
    h = harness()
    h.ready = threading.Event()
    h.kill(0)
    _until(lambda: bool(h.launched))
    h.fleet.close()
    assert h.launched[0].stopped
    assert h.fleet.servers[0] is not h.launched[0]


def test_without_healing_a_loss_is_recorded_and_nothing_replaces_it(harness):
    h = harness(healing=False)
    dead = h.kill(0)
    time.sleep(0.1)
    assert h.launched == [] and not dead.stopped  # the backend stops it at shutdown
    assert h.fleet.metrics()["replica_0_state"] == ReplicaState.DEAD


# ---- rows: RowRouter over a stand-in fleet ----------------------------------------------------


def _rows_on(h: Harness, *, streamed: frozenset[int] = frozenset(), dies: int = 1) -> Any:
    """Run 6 rows; the first time replica ``dies`` gets rows it finishes one and dies. Returns
    (which server ran each row, the error raised or None)."""
    router = RowRouter(lambda: h.fleet, max_in_flight=8)  # type: ignore[arg-type,return-value]
    ran: dict[int, str] = {}
    died = threading.Event()

    def work(server: StandIn, rows: list[int]) -> None:
        if server is h.servers[dies] and not died.is_set():
            died.set()
            ran[rows[0]] = server.name
            server.gone = True
            raise ServerLostError(f"{server.name} exited during a request", server)
        for row in rows:
            ran[row] = server.name

    def unfinished(rows: list[int]) -> tuple[list[int], list[int]]:
        left = [r for r in rows if r not in ran]
        return [r for r in left if r not in streamed], [r for r in left if r in streamed]

    error = None
    try:
        router.run(work, 6, threading.Event(), unfinished)  # type: ignore[arg-type]
    except Exception as exc:
        error = exc
    router.close()
    return ran, error


def test_rows_of_a_lost_server_that_handed_nothing_run_again_on_a_serving_one(harness):
    h = harness(3)
    h.ready = threading.Event()  # the replacement does not come up
    ran, error = _rows_on(h)
    assert error is None and sorted(ran) == list(range(6))
    assert ran[1] == "replica 1"  # it finished this one before it died
    assert ran[4] == "replica 0" or ran[4] == "replica 2"  # moved
    assert h.fleet.rows_rerun == 1 and h.fleet.health.state(1) is not ReplicaState.SERVING


def test_a_row_that_streamed_tokens_on_a_lost_server_ends_the_call_with_row_lost(harness):
    h = harness(2)
    _, error = _rows_on(h, streamed=frozenset({3}))
    assert isinstance(error, RowLostError) and error.rows == (3,) and error.retryable
    assert h.fleet.rows_lost == 1


def test_with_no_server_serving_a_call_fails_at_once(harness):
    h = harness(1)
    h.ready = threading.Event()  # the replacement does not come up
    h.kill(0)
    started = time.monotonic()
    ran, error = _rows_on(h, dies=0)
    assert isinstance(error, NoReplicaServingError) and ran == {}
    assert time.monotonic() - started < 1.0  # nothing waited for a replacement
    assert "1 being replaced" in str(error)


def test_rows_with_no_server_left_to_move_to_fail_with_no_replica_serving(harness):
    h = harness(1)
    h.ready = threading.Event()
    ran, error = _rows_on(h, dies=0)
    assert isinstance(error, NoReplicaServingError) and ran == {0: "replica 0"}


def test_fail_stop_a_lost_server_breaks_the_backend(harness):
    h = harness(2, healing=False)
    _, error = _rows_on(h)
    assert isinstance(error, BackendBrokenError) and "exited" in str(error)
