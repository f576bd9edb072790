"""The fleet's health state machine: legal paths, refused ones, the epoch, restarts, metrics."""

from __future__ import annotations

import logging

import pytest
from gen_backend_kit.fleet_health import FleetHealth, IllegalTransitionError, ReplicaState

S = ReplicaState


def test_a_replica_dies_restarts_and_is_admitted_at_the_fleet_s_version():
    fleet = FleetHealth(3, max_restarts=2, weight_version=4)
    assert fleet.serving() == [0, 1, 2]
    assert fleet.move(1, S.DEAD, "its stream ended")
    assert fleet.serving() == [0, 2] and fleet.epoch == 1
    assert fleet.record(1).weight_version is None
    assert fleet.may_restart(1)
    fleet.move(1, S.RESTARTING, "replacement")
    fleet.move(1, S.STALE, "engine up")
    assert fleet.serving() == [0, 2] and fleet.epoch == 1  # not a member until verified
    fleet.set_version(5)  # an update commits on the members meanwhile
    fleet.admit(1, 5)
    assert fleet.serving() == [0, 1, 2] and fleet.epoch == 2
    metrics = fleet.metrics()
    assert metrics["fleet_replicas_serving"] == 3 and metrics["fleet_restarts_total"] == 1
    assert [metrics[f"replica_{i}_weight_version"] for i in range(3)] == [5, 5, 5]
    assert metrics["fleet_epoch"] == 2 and metrics["fleet_restarts_left"] == 1


def test_a_suspect_replica_still_takes_rows_and_recovers_without_changing_the_epoch():
    fleet = FleetHealth(2, max_restarts=0)
    fleet.move(0, S.SUSPECT, "no progress for 5 s")
    assert fleet.serving() == [0, 1] and fleet.epoch == 0
    assert fleet.metrics()["replica_0_state"] == int(S.SUSPECT) == 1
    fleet.move(0, S.SERVING, "progress")
    assert fleet.record(0).weight_version == 0 and fleet.epoch == 0


@pytest.mark.parametrize(
    "path",
    [
        [S.RESTARTING],  # serving -> restarting: only a dead replica is replaced
        [S.STALE],
        [S.DEAD, S.SERVING],  # a dead replica never serves again without a replacement
        [S.DEAD, S.STALE],
        [S.DEAD, S.RESTARTING, S.SERVING],  # a replacement serves only once verified
        [S.SUSPECT, S.RESTARTING],
    ],
)
def test_transitions_the_state_machine_does_not_connect_are_refused(path):
    fleet = FleetHealth(1, max_restarts=5)
    for state in path[:-1]:
        fleet.move(0, state, "setup")
    before = fleet.record(0).state
    with pytest.raises(IllegalTransitionError, match="replica 0 cannot go from"):
        fleet.move(0, path[-1], "test")
    assert fleet.record(0).state is before


def test_a_repeated_report_changes_nothing_and_kill_works_from_any_live_state():
    fleet = FleetHealth(2, max_restarts=3)
    assert fleet.kill(0, "died")
    assert not fleet.kill(0, "died again") and fleet.epoch == 1
    fleet.move(0, S.RESTARTING, "replacement")
    assert fleet.kill(0, "the replacement died while loading")  # restarting -> dead
    assert fleet.epoch == 1  # it never was a member again
    assert fleet.restarts == 1


def test_past_its_restarts_the_fleet_runs_smaller_and_says_so(caplog):
    fleet = FleetHealth(3, max_restarts=1)
    fleet.kill(0, "died")
    assert fleet.may_restart(0)
    fleet.move(0, S.RESTARTING, "replacement")
    fleet.kill(2, "died")
    with caplog.at_level(logging.WARNING, logger="gen_backend_kit.fleet_health"):
        assert not fleet.may_restart(2)
        assert not fleet.may_restart(2)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "runs with 1 of 3 replicas" in warnings[0].getMessage()
    assert fleet.metrics()["fleet_restarts_left"] == 0
    assert not fleet.may_restart(1)  # a serving replica is never restarted


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least one replica"):
        FleetHealth(0, max_restarts=1)
    with pytest.raises(ValueError, match="max_restarts must be >= 0"):
        FleetHealth(2, max_restarts=-1)


def test_an_admitted_replica_is_never_seen_serving_without_its_version(caplog):
    """A reader of the metrics at the moment of admission (here: the transition's own log
    record, written just after the state changed) sees the replica serving at its version,
    never serving at -1 (unverified)."""
    fleet = FleetHealth(2, max_restarts=1, weight_version=3)
    fleet.move(0, S.DEAD, "lost")
    fleet.move(0, S.RESTARTING, "replacement")
    fleet.move(0, S.STALE, "engine up")
    seen: list[tuple[int | float, int | float]] = []

    class Reader(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "serving" in record.getMessage():
                metrics = fleet.metrics()
                seen.append((metrics["replica_0_state"], metrics["replica_0_weight_version"]))

    reader = Reader()
    logger = logging.getLogger("gen_backend_kit.fleet_health")
    logger.addHandler(reader)
    try:
        with caplog.at_level(logging.INFO, logger="gen_backend_kit.fleet_health"):
            fleet.admit(0, 3)
    finally:
        logger.removeHandler(reader)
    assert seen == [(int(S.SERVING), 3)]


def test_settled_means_no_replacement_under_way_nor_due():
    fleet = FleetHealth(2, max_restarts=1)
    assert fleet.settled()
    fleet.move(0, S.DEAD, "lost")
    assert not fleet.settled(), "a dead replica with a restart left is a replacement due"
    assert fleet.settled(replacements_due=False), "an owner that replaces no more is settled"
    fleet.move(0, S.RESTARTING, "replacement")
    assert not fleet.settled() and not fleet.settled(replacements_due=False)
    assert not fleet.replacement_failed(0, "it would not start"), "no restart was left"
    assert fleet.state(0) is S.DEAD and fleet.settled(), "restarts spent: it stays dead"
    assert fleet.wait_settled(0.1)
