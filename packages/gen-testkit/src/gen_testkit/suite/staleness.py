"""The staleness bound (``max_weight_staleness``) on any backend with weight updates.

With a bound of N, rows start only on weights at most N versions behind the newest version the
trainer announced (``announce_weight_version``, or ``start_weight_update``): a call waits for an
open update that closes the gap, and is refused with ``StaleWeightsError`` when none would. The
bound is a per-call setting, so each check runs on ``with_sampling`` front ends of one backend.
Every refit here reloads the subject's own weights under a new version number: outputs of other
tests are unchanged. Subclass it once per backend with a ``subject`` fixture whose
``state_dict`` is set.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from gen_interface import BatchedDataDict, GenerationInterface, StaleWeightsError
from gen_interface.weights import refit

from gen_testkit.strategies import pad_prompts
from gen_testkit.suite.base import ConformanceSubject
from gen_testkit.suite.in_thread import InThread

__all__ = ["StalenessChecks"]

PROMPTS = [[5, 17, 42, 8], [99, 3]]

#: How long a test waits for a call that must have finished; far beyond any real call here.
DONE_WITHIN_S = 120.0


def _batch() -> BatchedDataDict[Any]:
    return pad_prompts(PROMPTS, "left")


class StalenessChecks:
    """Rows never start on weights older than the bound allows; nothing is lost on a refusal."""

    @pytest.fixture
    def versions(self, subject: ConformanceSubject) -> Iterator[_Versions]:
        """Announces and refits for one test; afterwards the weights are refitted to the newest
        version announced, so that the next test starts within any bound."""
        assert subject.state_dict is not None, "the subject needs its state_dict"
        tracker = _Versions(subject)
        yield tracker
        backend = subject.backend
        if backend.weight_version < tracker.newest:
            refit(backend, subject.state_dict, version=tracker.newest)

    def test_without_a_bound_an_announcement_changes_nothing(
        self, subject: ConformanceSubject, versions: _Versions
    ) -> None:
        current = subject.backend.weight_version
        versions.announce(current + 5)
        out = _view(subject, None).generate(_batch(), greedy=True)
        assert out["weight_version"].tolist() == [current] * len(PROMPTS)

    def test_rows_are_refused_on_weights_too_far_behind_and_start_once_updated(
        self, subject: ConformanceSubject, versions: _Versions
    ) -> None:
        current = subject.backend.weight_version
        bounded = _view(subject, 1)
        versions.announce(current + 1)
        assert bounded.generate(_batch(), greedy=True)["weight_version"].tolist() == [current] * 2
        versions.announce(current + 2)
        stale = rf"version {current}, but version {current + 2}"
        with pytest.raises(StaleWeightsError, match=stale):
            bounded.generate(_batch(), greedy=True)
        with pytest.raises(StaleWeightsError):
            asyncio.run(_first_row(bounded))
        # Nothing was lost: the backend goes on, unbounded calls run on the old weights ...
        assert _view(subject, None).generate(_batch(), greedy=True).size == len(PROMPTS)
        # ... and bounded ones once the weights are one version behind the announced.
        versions.refit(current + 1)
        out = bounded.generate(_batch(), greedy=True)
        assert out["weight_version"].tolist() == [current + 1] * len(PROMPTS)

    def test_a_call_waits_for_the_open_update_that_closes_the_gap(
        self, subject: ConformanceSubject, versions: _Versions
    ) -> None:
        backend = subject.backend
        versions.open_update()  # announces the version it will commit
        try:
            call = InThread(lambda: _view(subject, 0).generate(_batch(), greedy=True))
            assert not call.done.wait(0.5), "the call ran on weights an open update replaces"
            versions.load_all_into_the_open_update()
            assert not call.done.is_set(), "the call started before the update committed"
        finally:
            committed = backend.commit_weight_update()
        out = call.result(DONE_WITHIN_S)
        assert out["weight_version"].tolist() == [committed] * len(PROMPTS)

    def test_a_call_waiting_on_an_update_that_is_aborted_is_refused(
        self, subject: ConformanceSubject, versions: _Versions
    ) -> None:
        backend = subject.backend
        target = versions.open_update()
        try:
            call = InThread(lambda: _view(subject, 0).generate(_batch(), greedy=True))
            assert not call.done.wait(0.5)
        finally:
            backend.abort_weight_update()
        with pytest.raises(StaleWeightsError, match=rf"version {target} was announced"):
            call.result(DONE_WITHIN_S)
        versions.refit(target)
        assert _view(subject, 0).generate(_batch(), greedy=True).size == len(PROMPTS)

    def test_an_async_call_waits_without_blocking_its_event_loop(
        self, subject: ConformanceSubject, versions: _Versions
    ) -> None:
        backend = subject.backend
        target = versions.open_update()
        committed_at: list[float] = []

        def load_and_commit() -> None:
            try:
                versions.load_all_into_the_open_update()
            finally:
                committed_at.append(time.monotonic())
                backend.commit_weight_update()

        async def scenario() -> tuple[list[float], BatchedDataDict[Any]]:
            first = asyncio.ensure_future(_first_row(_view(subject, 0)))
            ticks = []
            while not first.done():
                await asyncio.sleep(0.01)
                ticks.append(time.monotonic())
            return ticks, await first

        committer = threading.Timer(1.0, load_and_commit)
        committer.start()
        try:
            ticks, row = asyncio.run(scenario())
        finally:
            committer.join()
        assert row["weight_version"].tolist() == [target]
        before = [t for t in ticks if t < committed_at[0]]
        assert len(before) >= 10, "the event loop stood still while the call waited"


class _Versions:
    """Announces and refits the subject's own weights under new version numbers."""

    def __init__(self, subject: ConformanceSubject):
        self.subject = subject
        self.newest = subject.backend.weight_version

    def announce(self, version: int) -> None:
        self.subject.backend.announce_weight_version(version)
        self.newest = max(self.newest, version)

    def open_update(self) -> int:
        """Open an update to the next version (which announces it); returns that version."""
        target = self.subject.backend.start_weight_update(self.subject.backend.weight_version + 1)
        self.newest = max(self.newest, target)
        return target

    def refit(self, version: int) -> None:
        assert self.subject.state_dict is not None
        refit(self.subject.backend, self.subject.state_dict, version=version)

    def load_all_into_the_open_update(self) -> None:
        from gen_interface.weights import share_weights

        assert self.subject.state_dict is not None
        with share_weights(dict(self.subject.state_dict)) as shared:
            self.subject.backend.update_weights_from_ipc_handles(shared.handles)


def _view(subject: ConformanceSubject, bound: int | None) -> GenerationInterface:
    backend = subject.backend
    return backend.with_sampling(max_new_tokens=3, max_weight_staleness=bound)


async def _first_row(backend: Any) -> BatchedDataDict[Any]:
    stream = backend.generate_async(_batch(), greedy=True)
    try:
        async for _, row in stream:
            return row
    finally:
        await stream.aclose()
    raise AssertionError("generate_async yielded no row")
