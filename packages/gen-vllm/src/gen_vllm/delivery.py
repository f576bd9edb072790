"""``DeliveryTimes``: how long the token path takes, from an engine step's end to the caller.

Each worker message carries when the engine step that filled it ended (``StepBatch.ended``); the
driver records, as each call receives its part of a message, the seconds since. That is the
whole of what this backend adds on the token path per step (the worker's hand-over, Ray's
message, the driver's routing, the hand-over to the caller's event loop), measured where users
feel it, and reported by ``get_logger_metrics`` beside the engines' own figures.
"""

from __future__ import annotations

from collections import deque

__all__ = ["DeliveryTimes"]

#: Deliveries the percentiles are taken over (the most recent).
_KEPT = 10_000


class DeliveryTimes:
    """Seconds from a step's end to its tokens reaching the caller, since the last clear."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=_KEPT)
        self._count = 0
        self._total = 0.0

    def record(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)  # clocks of two processes may differ by microseconds
        self._recent.append(seconds)
        self._count += 1
        self._total += seconds

    def clear(self) -> None:
        self._recent.clear()
        self._count = 0
        self._total = 0.0

    def snapshot(self) -> dict[str, int | float]:
        """``step_to_caller_seconds_mean`` / ``_p50`` / ``_p99`` and the deliveries counted."""
        if not self._count:
            return {"step_to_caller_deliveries_total": 0}
        ordered = sorted(self._recent)
        return {
            "step_to_caller_deliveries_total": self._count,
            "step_to_caller_seconds_mean": self._total / self._count,
            "step_to_caller_seconds_p50": ordered[len(ordered) // 2],
            "step_to_caller_seconds_p99": ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)],
        }
