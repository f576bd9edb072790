"""``StepGate``: decode steps and weight updates take turns on one model.

Every forward pass of a ``generate`` call runs inside ``step()``, which holds the model lock; a
weight update opens with ``close(in_flight)`` and ends with ``reopen(version)``. While an update
is open no step runs, so no token ever comes from weights that are part old, part new. Between
the two, running calls wait (``"keep"``: they go on with the new weights afterwards) or are cut
short at their next step (``"abort"``: every call running when the update opened).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from gen_interface import InFlight

__all__ = ["StepGate", "StepTicket"]


@dataclass(frozen=True)
class StepTicket:
    """What a step may do: ``cut`` (end the call's rows now) and the weights' ``version``."""

    cut: bool
    version: int


class StepGate:
    """Args:
    lock: the model lock: held by every step and by every weight write.
    version: the version of the weights in place.
    """

    def __init__(self, lock: threading.Lock, version: int = 0):
        self.lock = lock
        self._turn = threading.Condition(lock)
        self._open_update = False
        self._cuts = 0  # updates in "abort" mode so far
        self._version = version

    def enter(self) -> int:
        """A call starts: the mark ``step`` compares against to learn whether it was cut."""
        with self._turn:
            return self._cuts

    @contextmanager
    def step(self, mark: int) -> Iterator[StepTicket]:
        """Hold the model for one step; waits while an update is open unless it cut this call."""
        with self._turn:
            while self._open_update and self._cuts == mark:
                self._turn.wait()
            yield StepTicket(cut=self._cuts != mark, version=self._version)

    def close(self, in_flight: InFlight) -> None:
        """An update opens: no step runs until ``reopen``; ``"abort"`` cuts running calls."""
        with self._turn:
            self._open_update = True
            if in_flight == "abort":
                self._cuts += 1
            self._turn.notify_all()

    def reopen(self, version: int | None) -> None:
        """The update ended: committed as ``version``, or dropped (None)."""
        with self._turn:
            self._open_update = False
            if version is not None:
                self._version = version
            self._turn.notify_all()
