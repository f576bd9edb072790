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
row, and the flag that ends the call early. ``GeneratedRows`` is what a decode loop's rows have
produced so far, and turns a row into its ``RowResult`` when it ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gen_backend_kit.outputs import RowResult

if TYPE_CHECKING:
    from gen_interface.interface import InFlight

    from gen_backend_kit.sampling import TokenChoice

__all__ = ["GeneratedRows", "RowControl", "StepGate", "StepTicket"]


@dataclass
class RowControl:
    """One call's link to the caller while its rows run.

    Attributes:
        on_row: called with (call row index, result) as each row finishes, from the thread that
            decodes; None when nobody streams the rows.
        on_token: called with (call row index, token, logprob, top-k ids, top-k logprobs) as
            each token is chosen, from the thread that decodes; None when nobody streams tokens.
        cancelled: set it to end the call at its next step (rows not finished are dropped).
    """

    on_row: Callable[[int, RowResult], object] | None = None
    on_token: Callable[[int, int, float, list[int], list[float]], object] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def finished(self, row: int, result: RowResult) -> RowResult:
        """Report row ``row`` as finished; returns ``result``."""
        if self.on_row is not None:
            self.on_row(row, result)
        return result


class GeneratedRows:
    """The tokens, logprobs, weight versions and top logprobs of ``count`` rows so far.

    Rows are numbered as the decode loop numbers them; ``record`` appends one step's choice for
    the rows still running, ``ended`` builds a row's ``RowResult``, and ``publish``, once the
    step's finished rows are ended, tells the listener of the step's tokens. A token that ended
    its row is not published: it reaches the caller with the row's result, so a stream's last
    event holds the last token and the finish together (as vLLM's server sends them).

    Args:
        top_logprobs: each row's ``top_logprobs`` (how many of a step's top-k entries it keeps).
        call_rows: each row's index in the call, for ``control`` (default: the same numbers).
        control: hears of every token recorded (``RowControl.on_token``), if it listens.
    """

    def __init__(
        self,
        top_logprobs: Sequence[int],
        call_rows: Sequence[int] | None = None,
        control: RowControl | None = None,
    ):
        count = len(top_logprobs)
        self._keep = list(top_logprobs)
        self._call_rows = list(call_rows) if call_rows is not None else list(range(count))
        self._on_token = control.on_token if control is not None else None
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.logprobs: list[list[float]] = [[] for _ in range(count)]
        self.versions: list[list[int]] = [[] for _ in range(count)]
        self.topk_ids: list[list[list[int]]] = [[] for _ in range(count)]
        self.topk_logprobs: list[list[list[float]]] = [[] for _ in range(count)]
        # rows whose last token the listener has not heard of, in the order recorded
        self._unpublished: dict[int, None] = {}

    def record(self, rows: list[int], choice: TokenChoice, version: int) -> None:
        """Append ``choice`` (one entry per row of ``rows``, in order), made by weights
        ``version``."""
        ids, values = choice.topk_ids.tolist(), choice.topk_logprobs.tolist()
        for slot, (row, token, logprob) in enumerate(
            zip(rows, choice.tokens.tolist(), choice.logprobs.tolist())
        ):
            self.tokens[row].append(token)
            self.logprobs[row].append(logprob)
            self.versions[row].append(version)
            self.topk_ids[row].append(ids[slot][: self._keep[row]])
            self.topk_logprobs[row].append(values[slot][: self._keep[row]])
        if self._on_token is not None:
            self._unpublished.update(dict.fromkeys(rows))

    def publish(self) -> None:
        """Tell the listener (``RowControl.on_token``) of the tokens recorded since the last
        call, except those of rows ended since: call once per step, after ending its rows."""
        rows, self._unpublished = list(self._unpublished), {}
        if self._on_token is None:
            return
        for row in rows:
            self._on_token(
                self._call_rows[row],
                self.tokens[row][-1],
                self.logprobs[row][-1],
                self.topk_ids[row][-1],
                self.topk_logprobs[row][-1],
            )

    def ended(self, row: int, finish_reason: str, version_now: int) -> RowResult:
        """Row ``row``'s result, ended for ``finish_reason`` (``RowResult.ended``'s rules);
        ``version_now`` is the version it started on when it generated nothing. Its token of
        this step, if any, is left to the result (``publish`` skips it)."""
        self._unpublished.pop(row, None)
        return RowResult.ended(
            finish_reason,
            self.tokens[row],
            self.logprobs[row],
            weight_version=self.versions[row][0] if self.versions[row] else version_now,
            weight_versions=self.versions[row],
            topk_ids=self.topk_ids[row],
            topk_logprobs=self.topk_logprobs[row],
        )


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
