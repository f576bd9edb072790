"""``DeliveryTimes``: how long the token path takes, from an engine step's end to a point on it.

Each worker message carries when the engine step that filled it ended (``StepBatch.ended``).
Two points on the path record the seconds since:

- ``step_to_driver``: the router, as a message carrying rows' tokens or results reaches this
  process (the worker's hand-over and Ray's message between the two processes);
- ``step_to_caller``: each call, as it receives its part of a message (adding the driver's
  routing and the hand-over to the caller's event loop).

``step_to_caller`` is the whole of what this backend adds on the token path per step, measured
where users feel it; the difference between the two is this process's share of it. Both are
reported by ``get_logger_metrics`` beside the engines' own figures.
"""

from __future__ import annotations

import threading
from collections import deque

__all__ = ["DeliveryTimes"]

#: Deliveries the percentiles are taken over (the most recent).
_KEPT = 10_000


class DeliveryTimes:
    """Seconds from a step's end to ``point`` on the token path, since the last clear;
    recorded and read from any thread.

    Args:
        point: the metrics' prefix, ``"step_to_caller"`` or ``"step_to_driver"``.
    """

    def __init__(self, point: str = "step_to_caller") -> None:
        self.point = point
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=_KEPT)
        self._count = 0
        self._total = 0.0

    def record(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)  # clocks of two processes may differ by microseconds
        with self._lock:
            self._recent.append(seconds)
            self._count += 1
            self._total += seconds

    def clear(self) -> None:
        with self._lock:
            self._recent.clear()
            self._count = 0
            self._total = 0.0

    def snapshot(self) -> dict[str, int | float]:
        """``<point>_seconds_mean`` / ``_p50`` / ``_p99`` and ``<point>_deliveries_total``."""
        with self._lock:
            count, total, ordered = self._count, self._total, sorted(self._recent)
        name = self.point
        if not count:
            return {f"{name}_deliveries_total": 0}
        return {
            f"{name}_deliveries_total": count,
            f"{name}_seconds_mean": total / count,
            f"{name}_seconds_p50": ordered[len(ordered) // 2],
            f"{name}_seconds_p99": ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)],
        }
