"""Decode steps and weight updates taking turns on one in-process model.

A backend that decodes step by step in its own process (gen-hf, the testkit's n-gram backend)
runs every forward pass inside ``StepGate.step()``, which holds the model lock; a weight update
opens with ``close(in_flight)`` and ends with ``reopen(...)``. While an update is open no step
runs, so no token comes from weights that are being written. Between the two, running calls
wait (``"keep"``: they go on with the new weights after a commit) or are cut short at their next
step (``"abort"``: every call running when the update opened). An update dropped after some of
it was written cuts the calls it paused as well: their next token would come from weights that
are part old, part new.

``RowControl`` is a call's link to the world outside its decode loop: who hears of each finished
row, and the flag that ends the call early.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gen_interface.interface import InFlight
    from gen_interface.outputs import RowResult

__all__ = ["RowControl", "StepGate", "StepTicket"]


@dataclass
class RowControl:
    """One call's link to the caller while its rows run.

    Attributes:
        on_row: called with (call row index, result) as each row finishes, from the thread that
            decodes; None when nobody streams the rows.
        cancelled: set it to end the call at its next step (rows not finished are dropped).
    """

    on_row: Callable[[int, RowResult], object] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def finished(self, row: int, result: RowResult) -> RowResult:
        """Report row ``row`` as finished; returns ``result``."""
        if self.on_row is not None:
            self.on_row(row, result)
        return result


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

    def __init__(self, lock: threading.Lock | None = None, version: int = 0):
        self.lock = lock if lock is not None else threading.Lock()
        self._turn = threading.Condition(self.lock)
        self._open_update = False
        self._cuts = 0  # how many times running calls were cut so far
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

    def reopen(self, version: int | None, *, cut: bool = False) -> None:
        """The update ended: committed as ``version``, or dropped (None).

        Args:
            version: the committed version, or None when the update was dropped.
            cut: end every call that entered before now at its next step, with its tokens so
                far: the update was dropped after some of it was written.
        """
        with self._turn:
            self._open_update = False
            if version is not None:
                self._version = version
            if cut:
                self._cuts += 1
            self._turn.notify_all()
