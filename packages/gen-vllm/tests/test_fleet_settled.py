"""``Fleet.settled``: settled only once no replacement is under way or due, so waiting for it
never returns in the moment between a loss and its replacement's start."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from gen_backend_kit.fleet_health import FleetHealth, ReplicaState
from gen_vllm.fleet import Fleet


def _fleet(max_restarts: int) -> Fleet:
    loop = asyncio.new_event_loop()
    loop.close()  # never run: nothing here reaches the driver's loop
    replicas = SimpleNamespace(members=None)
    health = FleetHealth(2, max_restarts=max_restarts)
    return Fleet(replicas, health, loop=loop, refit_deadline_s=1.0, prepare=lambda actor: None)


def test_a_dead_replica_with_restarts_left_is_not_settled_until_replaced():
    fleet = _fleet(max_restarts=2)
    assert fleet.settled()
    fleet.health.kill(0, "its worker died")  # a replacement is due, not started yet
    assert not fleet.settled() and not fleet.wait_settled(0.1)
    fleet.health.move(0, ReplicaState.RESTARTING, "a replacement is starting")
    assert not fleet.settled()
    fleet.health.move(0, ReplicaState.STALE, "engine up")
    assert not fleet.settled()
    fleet.health.admit(0, 0)
    assert fleet.settled() and fleet.wait_settled(0.1)


def test_a_dead_replica_with_no_restart_left_or_a_closed_fleet_is_settled():
    spent = _fleet(max_restarts=0)
    spent.health.kill(1, "its worker died")
    assert spent.settled()  # it stays dead: the fleet runs smaller
    closed = _fleet(max_restarts=3)
    closed.health.kill(1, "its worker died")
    closed.close()
    assert closed.settled()  # no replacement comes after close
