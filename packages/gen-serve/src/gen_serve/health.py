"""What ``/health`` answers: the server's and its backend's health, from the backend's state and
the fleet counts of its ``get_logger_metrics()``.

vLLM's ``/health`` is a bare 200; clients that read only the status code keep working: every
usable server answers 200, with an empty body when nothing is amiss. The answers, first match:

- the server is shutting down: 503 ``{"status": "draining", "message"}``;
- the backend is broken or shut down: 503 ``{"status": "unusable", "backend_state", "message"}``;
- its metrics could not be read (an error, or no answer in time): 503
  ``{"status": "unresponsive", "message"}``;
- no fleet (no ``fleet_replicas_serving`` among the metrics): 200, empty;
- a fleet in which no replica takes rows: 503 ``{"status": "unavailable", <fleet>}``;
- a fleet in which some replica is not serving: 200 ``{"status": "degraded", <fleet>}``;
- a fleet in which every replica serves: 200, empty.

``<fleet>`` is the count of replicas in each state (``serving``, ``suspect``, ``dead``,
``restarting``, ``stale``: the kit's ``FleetHealth`` states), ``replicas`` (the fleet's full
size), ``epoch`` (its membership epoch) and ``restarts_left``. Suspect replicas still take rows
(they only sent nothing for a while), so a fleet whose replicas are all suspect is degraded, not
unavailable; a fleet with none serving or suspect fails every call (``NoReplicaServingError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["HealthAnswer", "health_answer"]

_FLEET_PREFIX = "fleet_replicas_"
#: The states whose replicas take rows.
_TAKING_ROWS = ("serving", "suspect")


@dataclass(frozen=True)
class HealthAnswer:
    """``/health``'s status code and JSON body (None: an empty body)."""

    status: int
    body: dict[str, Any] | None = None


def health_answer(
    *,
    draining: bool,
    backend_state: str,
    metrics: Mapping[str, int | float] | None,
    metrics_error: str | None = None,
) -> HealthAnswer:
    """The answer for a server in this state (see the module's table).

    Args:
        draining: the server is shutting down.
        backend_state: the backend's ``state`` (``"broken"`` and ``"shut down"`` are unusable).
        metrics: the backend's ``get_logger_metrics()``; None when they could not be read.
        metrics_error: why they could not be read.
    """
    if draining:
        return HealthAnswer(
            503,
            {
                "status": "draining",
                "message": "the server is shutting down; send requests to another server",
            },
        )
    if backend_state in ("broken", "shut down"):
        return HealthAnswer(
            503,
            {
                "status": "unusable",
                "backend_state": backend_state,
                "message": f"the backend is {backend_state}: every call would fail; restart "
                "the server",
            },
        )
    if metrics is None:
        return HealthAnswer(
            503,
            {
                "status": "unresponsive",
                "message": "the backend did not report its metrics"
                + (f": {metrics_error}" if metrics_error else ""),
            },
        )
    states = _fleet_states(metrics)
    if states is None:
        return HealthAnswer(200)
    fleet = {**states, **_fleet_figures(metrics, states)}
    if sum(states.get(state, 0) for state in _TAKING_ROWS) == 0:
        return HealthAnswer(503, {"status": "unavailable", **fleet})
    if any(count for state, count in states.items() if state != "serving"):
        return HealthAnswer(200, {"status": "degraded", **fleet})
    return HealthAnswer(200)


def _fleet_states(metrics: Mapping[str, int | float]) -> dict[str, int] | None:
    """Replicas per state (``fleet_replicas_<state>``); None when the backend runs no fleet."""
    if f"{_FLEET_PREFIX}serving" not in metrics:
        return None
    return {
        name[len(_FLEET_PREFIX) :]: int(value)
        for name, value in sorted(metrics.items())
        if name.startswith(_FLEET_PREFIX)
    }


def _fleet_figures(metrics: Mapping[str, int | float], states: Mapping[str, int]) -> dict[str, int]:
    """The fleet's full size (``replicas``), membership ``epoch`` and ``restarts_left``."""
    out = {"replicas": int(metrics.get("fleet_size", sum(states.values())))}
    for field, name in (("epoch", "fleet_epoch"), ("restarts_left", "fleet_restarts_left")):
        if name in metrics:
            out[field] = int(metrics[name])
    return out
