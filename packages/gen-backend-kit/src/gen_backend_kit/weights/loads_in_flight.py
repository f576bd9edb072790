"""The loads of one weight update that were handed to the workers and have not finished.

A backend whose workers queue loads (gen-vllm) returns from a load's submission at once and is
waited on outside the transaction's lock, so the next load is queued while this one runs and
each call's latency hides behind the previous load. The commit and the abort wait here first:
nothing ends an update while one of its loads still runs.
"""

from __future__ import annotations

import threading
import time

__all__ = ["LoadsInFlight"]


class LoadsInFlight:
    """How many loads run now, and the wall time during which at least one ran (loads that
    overlap count once): the update's ``load`` phase."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running = 0
        self._since = 0.0
        self.seconds = 0.0

    def started(self) -> None:
        with self._changed:
            if self._running == 0:
                self._since = time.perf_counter()
            self._running += 1

    def finished(self) -> None:
        with self._changed:
            self._running -= 1
            if self._running == 0:
                self.seconds += time.perf_counter() - self._since
                self._changed.notify_all()

    def wait_idle(self) -> None:
        """Return once no load runs (each load's own timeout bounds the wait)."""
        with self._changed:
            self._changed.wait_for(lambda: self._running == 0)
