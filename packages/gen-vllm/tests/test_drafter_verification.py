"""The drafter model in the weight reports: replicas whose drafters differ are caught after a
refit, a replacement is verified on its drafter too, and a replacement that joined an update
without the drafter's weights waits for one that carries them, rather than being evicted or
admitted with a drafter the fleet no longer runs."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from gen_backend_kit.fleet_health import FleetHealth, ReplicaState
from gen_interface import MixedWeightsError
from gen_vllm.fleet import Fleet
from gen_vllm.messages import UpdateReport
from gen_vllm.refit import verify_update, weights_differ


def _report(model: int = 1, packed: int = 2, drafter: int | None = 3, kernel: str = "cpu"):
    report = UpdateReport(
        rank=0,
        device_id="cpu",
        received_checksum=9,
        model_checksum=model,
        packed_checksum=packed,
        kernel=kernel,
    )
    if drafter is not None:
        report["drafter_checksum"] = drafter
    return [report]


def test_a_different_drafter_is_told_apart_from_a_different_target():
    assert weights_differ(_report(), _report()) is None
    assert "drafter model" in (weights_differ(_report(), _report(drafter=4)) or "")
    assert weights_differ(_report(), _report(drafter=4), drafter=False) is None
    assert "other parameters" in (weights_differ(_report(), _report(model=5, drafter=4)) or "")
    # kernel-bound like the packed layers: not compared across kinds of CPU
    assert weights_differ(_report(), _report(drafter=4, kernel="other")) is None
    # reports without a drafter model (or from before the key existed) compare equal
    assert weights_differ(_report(drafter=None), _report(drafter=None)) is None


def test_replicas_whose_drafters_differ_after_one_update_are_mixed_weights():
    assert len(verify_update([_report(), _report()])) == 2
    with pytest.raises(MixedWeightsError, match="drafter"):
        verify_update([_report(), _report(drafter=4)])
    verify_update([_report(), _report(drafter=4, kernel="other")])  # not comparable: passes


def _fleet_with_joining(replicas: list[int]) -> Fleet:
    loop = asyncio.new_event_loop()
    loop.close()  # never run: nothing here reaches the driver's loop
    fleet = Fleet(
        SimpleNamespace(members=None, pinned=[0, *replicas], killed=[]),
        FleetHealth(1 + len(replicas), max_restarts=0),
        loop=loop,
        refit_deadline_s=1.0,
        prepare=lambda actor: None,
    )
    fleet.replicas.kill = fleet.replicas.killed.append
    for replica in replicas:
        fleet.health.kill(replica, "its worker died")
        fleet.health.move(replica, ReplicaState.RESTARTING, "a replacement is starting")
        fleet.health.move(replica, ReplicaState.STALE, "engine up, joins the next update")
        fleet._joining.add(replica)
    return fleet


def test_a_joiner_short_of_the_drafter_waits_and_one_short_of_the_target_is_lost():
    fleet = _fleet_with_joining([1, 2])
    fleet.check_joining({1: _report(drafter=4), 2: _report(model=5)}, _report())
    assert fleet.joining() == [1]  # waits, unrouted, for an update carrying the drafter
    assert fleet.replicas.pinned == [0]  # admitted by neither at this commit
    assert fleet.health.state(1) == ReplicaState.STALE
    assert fleet.health.state(2) == ReplicaState.DEAD and fleet.replicas.killed == [2]
    fleet.unpin(7)
    assert fleet.health.state(1) == ReplicaState.STALE and fleet.joining() == [1]
