"""Loads handed over to workers that queue them (``WeightUpdateSteps.load`` returning a wait):
the next load is handed over while one runs, the commit and the abort wait for running loads,
a failed load reaches its caller, and the load phase counts overlapping loads once."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from gen_backend_kit.lifecycle import Lifecycle
from gen_backend_kit.weights import loads_in_flight
from gen_backend_kit.weights.loads_in_flight import LoadsInFlight
from gen_backend_kit.weights.updates import LoadWait, WeightUpdates, WeightUpdateSteps
from gen_interface import WeightUpdateError

SPEC = (torch.Size([2]), torch.float32)
MODEL = {name: SPEC for name in ("a", "b", "c")}
WAIT_S = 10.0


class QueuedLoads:
    """Workers that queue each load and finish it when the test says so (or fail it)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.release: dict[str, threading.Event] = {}
        self.failing: set[str] = set()
        self.updates = WeightUpdates(
            Lifecycle("queued"),
            MODEL,
            (),
            WeightUpdateSteps(
                load=self._load,
                commit=lambda version: self.events.append(f"commit {version}"),
                abort=lambda written: self.events.append(f"abort written={written}"),
            ),
        )

    def _load(self, handles: object) -> LoadWait:
        name = str(handles)
        self.events.append(f"handed {name}")
        done = self.release.setdefault(name, threading.Event())

        def wait() -> None:
            assert done.wait(WAIT_S), f"load {name} was never released"
            self.events.append(f"finished {name}")
            if name in self.failing:
                raise WeightUpdateError(f"load {name} failed on a worker")

        return wait

    def load_in_thread(self, name: str) -> tuple[threading.Thread, list[BaseException]]:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self.updates.load_described({name: SPEC}, lambda: self._load(name))
            except BaseException as exc:
                errors.append(exc)

        self.release.setdefault(name, threading.Event())
        thread = threading.Thread(target=run)
        thread.start()
        return thread, errors


def _until(condition: Callable[[], bool]) -> None:
    stop = threading.Event()
    for _ in range(int(WAIT_S * 100)):
        if condition():
            return
        stop.wait(0.01)
    raise AssertionError("timed out")


def test_the_next_load_is_handed_over_while_one_runs():
    loads = QueuedLoads()
    loads.updates.start()
    first, _ = loads.load_in_thread("a")
    _until(lambda: "handed a" in loads.events)
    second, _ = loads.load_in_thread("b")
    _until(lambda: "handed b" in loads.events)
    assert loads.events == ["handed a", "handed b"]  # neither finished: both in flight
    loads.release["a"].set()
    loads.release["b"].set()
    first.join(WAIT_S)
    second.join(WAIT_S)
    loads.updates.load_described({"c": SPEC}, lambda: None)  # one that needs no wait
    assert loads.updates.commit() == 1
    assert loads.events[-1] == "commit 1"


def test_the_commit_waits_for_loads_still_running():
    loads = QueuedLoads()
    loads.updates.start()
    loads.updates.load_described({"c": SPEC}, lambda: None)
    loads.updates.load_described({"b": SPEC}, lambda: None)
    running, _ = loads.load_in_thread("a")
    _until(lambda: "handed a" in loads.events)
    committed: list[int] = []
    committer = threading.Thread(target=lambda: committed.append(loads.updates.commit()))
    committer.start()
    committer.join(0.2)
    assert committer.is_alive() and not committed  # held until the load ends
    loads.release["a"].set()
    committer.join(WAIT_S)
    running.join(WAIT_S)
    assert committed == [1]
    assert loads.events == ["handed a", "finished a", "commit 1"]


def test_a_failed_queued_load_reaches_its_caller_and_the_update_aborts_written():
    loads = QueuedLoads()
    loads.updates.start()
    loads.failing.add("a")
    loads.release["a"] = threading.Event()
    loads.release["a"].set()
    thread, errors = loads.load_in_thread("a")
    thread.join(WAIT_S)
    assert len(errors) == 1 and isinstance(errors[0], WeightUpdateError)
    loads.updates.abort()
    assert loads.events == ["handed a", "finished a", "abort written=True"]
    assert not loads.updates.in_progress


def test_the_abort_waits_for_a_load_still_running():
    loads = QueuedLoads()
    loads.updates.start()
    running, _ = loads.load_in_thread("a")
    _until(lambda: "handed a" in loads.events)
    aborter = threading.Thread(target=loads.updates.abort)
    aborter.start()
    aborter.join(0.2)
    assert aborter.is_alive()  # the workers still load: the update cannot end under them
    loads.release["a"].set()
    aborter.join(WAIT_S)
    running.join(WAIT_S)
    assert loads.events == ["handed a", "finished a", "abort written=True"]


def test_a_refused_load_is_never_handed_over():
    loads = QueuedLoads()
    loads.updates.start()
    with pytest.raises(WeightUpdateError, match="not a weight of the model"):
        loads.updates.load_described({"nope": SPEC}, lambda: loads._load("nope"))
    assert loads.events == []


def test_overlapping_loads_count_once_in_the_load_phase(monkeypatch: pytest.MonkeyPatch):
    clock = iter([0.0, 2.0, 5.0, 6.0])  # only the first start and the last finish of a run
    monkeypatch.setattr(loads_in_flight.time, "perf_counter", lambda: next(clock))
    loads = LoadsInFlight()
    loads.started()  # t=0
    loads.started()  # overlaps
    loads.finished()
    loads.finished()  # t=2: none runs
    assert loads.seconds == 2.0
    loads.started()  # t=5
    loads.finished()  # t=6
    assert loads.seconds == 3.0
    loads.wait_idle()  # returns at once: nothing runs
