"""``WeightUpdates``: the weight-update transaction flow every backend shares.

A backend says how to begin, load, commit and abort on its own workers; this class owns the
rules: one transaction at a time, each load checked before it is written, a single-call update
being a complete transaction that is checked in full before anything is written, the version, and
what the lifecycle learns (weights woken for the update, real weights present or not), and the
optional staleness bound on where rows may start.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gen_interface.errors import StaleWeightsError, WeightBaseError, WeightUpdateError
from gen_interface.weights.handles import LoadSize, describe_weight_handles

from gen_backend_kit.lifecycle import Lifecycle, LifecycleView
from gen_backend_kit.metrics import GenerationMetrics
from gen_backend_kit.weights.consumer import TensorSpecs, check_update_is_complete, delta_bases
from gen_backend_kit.weights.loads_in_flight import LoadsInFlight
from gen_backend_kit.weights.transaction import WeightTransaction, next_version

if TYPE_CHECKING:
    from gen_interface.interface import InFlight

__all__ = ["LoadWait", "WeightUpdateSteps", "WeightUpdates"]

logger = logging.getLogger(__name__)


#: Waits for a load that was handed to the workers; raises as the load would have.
LoadWait = Callable[[], None]


def _nothing(*_: Any) -> None:
    return None


def _cannot_restore() -> bool:
    return False


@dataclass(frozen=True)
class WeightUpdateSteps:
    """What a backend does at each step of a transaction.

    Attributes:
        load: load one set of handles (already checked against the model) into every worker.
            It may raise ``WeightUpdateError`` before writing anything. It may instead hand the
            load to workers that run loads in the order they were handed them and return a
            function that waits for it (raising as the load would): that wait runs outside
            the transaction's lock, so the next load is handed over while this one runs.
        begin: prepare the workers for loads (e.g. pause generation, vLLM's
            ``start_weight_update``); receives the version and what to do with running rows.
        commit: finish on the workers, verify that all took the same weights, and let paused
            rows go on with them; receives the version. If it raises, ``abort`` runs next.
        abort: end the update on the workers without a new version (an abort, a refused or
            failed commit); receives whether loads were written. When they were, rows paused
            by ``begin`` must not go on with these weights: they end, cut short.
        restore: after loads were written, put the old weights back if the backend can (a
            ``CommittedWeights`` that undoes the update's deltas); returns whether it did.
            When it did, ``abort`` receives False and the backend serves as before.
    """

    load: Callable[[Mapping[str, Any]], LoadWait | None]
    begin: Callable[[int, InFlight], None] = _nothing
    commit: Callable[[int], None] = _nothing
    abort: Callable[[bool], None] = _nothing
    restore: Callable[[], bool] = _cannot_restore


class WeightUpdates:
    """One backend's weight version and its transaction in progress, if any.

    Args:
        lifecycle: the backend's; updates wake sleeping weights and set whether real weights
            are present.
        model: the model's ``{name: (shape, dtype)}``.
        optional: names an update may omit (aliases of tied weights).
        steps: the backend's part.
        staged: names the backend stages until the commit (an adapter): an update dropped
            after writing only these left the served weights as they were.
    """

    def __init__(
        self,
        lifecycle: Lifecycle | LifecycleView,
        model: TensorSpecs,
        optional: Collection[str],
        steps: WeightUpdateSteps,
        metrics: GenerationMetrics | None = None,
        staged: Collection[str] = (),
    ):
        self.lifecycle = lifecycle
        self.metrics = metrics if metrics is not None else GenerationMetrics()
        self._timing = _UpdateTiming()
        self.model = model
        self.optional = frozenset(optional)
        self.staged = frozenset(staged)
        self.groups = (self.staged,) if self.staged else ()
        self.steps = steps
        self.version = 0
        #: The newest version the trainer announced (``announce``, or by opening an update).
        self.announced = 0
        self._open: WeightTransaction | None = None
        self._lock = threading.RLock()
        #: Notified whenever the version, the announcement or the open transaction changes.
        self._changed = threading.Condition()

    @property
    def in_progress(self) -> bool:
        return self._open is not None

    def start(self, version: int | None = None, in_flight: InFlight = "keep") -> int:
        """Open a transaction; see ``GenerationInterface.start_weight_update``."""
        with self._lock:
            if self._open is not None:
                raise WeightUpdateError(
                    f"a weight update (to version {self._open.version}) is already in progress: "
                    "commit_weight_update() or abort_weight_update() first"
                )
            target = next_version(self.version, version)
            started = time.perf_counter()
            self.lifecycle.begin_update()
            try:
                self.steps.begin(target, in_flight)
            except BaseException:
                self.lifecycle.end_update()
                raise
            with self._changed:
                self._open = WeightTransaction(self.model, self.optional, target, self.groups)
                self.announced = max(self.announced, target)
            self._timing = _UpdateTiming(started, begin_seconds=time.perf_counter() - started)
            return target

    def load(self, handles: Mapping[str, Any]) -> None:
        """One load of the open transaction, or a complete transaction of its own."""
        slots = [slot for bucket in handles.get("buckets", []) for slot in bucket["tensors"]]
        incoming = describe_weight_handles(handles)
        self.load_described(
            incoming,
            lambda: self.steps.load(handles),
            size=_size(handles),
            bases=delta_bases(slots),
        )

    def load_described(
        self,
        incoming: TensorSpecs,
        write: Callable[[], LoadWait | None],
        *,
        size: LoadSize | None = None,
        bases: Collection[int] = (),
    ) -> None:
        """``load`` for any source: ``incoming`` describes what ``write`` writes (an in-process
        state dict, a collective broadcast). ``write`` may return a wait (see
        ``WeightUpdateSteps.load``); this returns when the load has finished either way.

        Args:
            size: what the load carries (tensors, deltas, bytes), for the metrics; default:
                every tensor of ``incoming`` whole.
            bases: the base versions its deltas name: each must be the committed version, or
                the load is refused before anything is written (``WeightBaseError``).
        """
        with self._lock:
            self._check_bases(bases)
            if self._open is None:
                self._load_whole(incoming, write, size)
                return
            self._open.accept_specs(incoming)  # a refused load changes nothing
            timing = self._timing
            wait = self._submit(timing, incoming, write, size)
        if wait is not None:
            _finish(timing.loads, wait)

    def _check_bases(self, bases: Collection[int]) -> None:
        other = sorted(set(bases) - {self.version})
        if other:
            why = "a version was skipped" if other[0] > self.version else "an older base"
            raise WeightBaseError(
                f"weight update refused, nothing of this load was written: it carries deltas "
                f"against version {other[0]}, and the committed weights here are version "
                f"{self.version} ({why}): send the weights whole"
            )

    def _load_whole(
        self, incoming: TensorSpecs, write: Callable[[], LoadWait | None], size: LoadSize | None
    ) -> None:
        """A single call is a whole update: check it all before anything is written."""
        check_update_is_complete(incoming, self.model, self.optional, self.groups)
        self.start()
        try:
            assert self._open is not None
            self._open.accept_specs(incoming)
            wait = self._submit(self._timing, incoming, write, size)
            if wait is not None:
                _finish(self._timing.loads, wait)
            self.commit()
        except BaseException:
            self.abort()
            raise

    def commit(self, version: int | None = None) -> int:
        """Close the transaction; see ``GenerationInterface.commit_weight_update``."""
        with self._lock:
            txn = self._require_open("commit_weight_update")
            self._timing.loads.wait_idle()
            if version is not None:
                txn.version = next_version(self.version, version)  # checks it is an int >= 0
                with self._changed:
                    self.announced = max(self.announced, txn.version)
            try:
                txn.check_complete()
            except WeightUpdateError:
                self.abort()
                raise
            committing = time.perf_counter()
            try:
                self.steps.commit(txn.version)
            except BaseException:
                self._drop(txn, why="verifying it failed")
                raise
            commit_seconds = time.perf_counter() - committing
            with self._changed:
                self.version = txn.version
                self._open = None
                self._changed.notify_all()
            timing = self._timing
            self.metrics.refit_committed(
                time.perf_counter() - timing.started,
                {
                    "begin": timing.begin_seconds,
                    "load": timing.loads.seconds,
                    "commit": commit_seconds,
                },
                timing.size.whole_bytes,
                timing.size,
            )
            self.metrics.set_weight_version(txn.version)
            self.lifecycle.weights_arrived()
            self.lifecycle.end_update()
            return txn.version

    def abort(self) -> None:
        """Drop the transaction; see ``GenerationInterface.abort_weight_update``."""
        with self._lock:
            if self._open is not None:
                self._drop(self._open, why="it was aborted after loads were written", strict=True)

    def _drop(self, txn: WeightTransaction, *, why: str, strict: bool = False) -> None:
        """End ``txn`` without a new version: the backend's abort step, then the bookkeeping,
        which happens even when that step fails. ``strict``: the step's error propagates
        (otherwise it is logged: an error is already on its way to the caller)."""
        self._timing.loads.wait_idle()  # a load still running ends before the update does
        written = txn.loads > 0 and bool(txn.received - self.staged)  # served weights touched
        if written:
            try:
                written = not self.steps.restore()
            except Exception:
                logger.exception("putting the old weights back after a dropped update failed")
        try:
            self.steps.abort(written)
        except Exception:
            if strict:
                raise
            logger.exception("ending a failed weight update on the workers failed too")
        finally:
            if written:
                self.lifecycle.weights_discarded(
                    f"a weight update left them part old, part new: {why}; commit a complete update"
                )
            with self._changed:
                self._open = None
                self._changed.notify_all()
            self.lifecycle.end_update()

    # ---- the staleness bound ------------------------------------------------------------

    def announce(self, version: int) -> int:
        """The trainer's weights reached ``version``, sent or not; see
        ``GenerationInterface.announce_weight_version``. Returns the newest announced."""
        next_version(self.version, version)  # checks that it is an integer >= 0
        with self._changed:
            self.announced = max(self.announced, version)
            self._changed.notify_all()
            return self.announced

    @staticmethod
    def _submit(
        timing: _UpdateTiming,
        incoming: TensorSpecs,
        write: Callable[[], LoadWait | None],
        size: LoadSize | None = None,
    ) -> LoadWait | None:
        """Run ``write``; its wait when it handed the load over (still running) instead."""
        timing.loads.started()
        try:
            wait = write()
        except BaseException:
            timing.loads.finished()
            raise
        if size is None:
            whole = sum(shape.numel() * dtype.itemsize for shape, dtype in incoming.values())
            size = LoadSize(len(incoming), 0, whole, whole)
        timing.size += size
        if wait is None:
            timing.loads.finished()
        return wait

    def admit(self, max_staleness: int | None, rows: int = 1) -> None:
        """Return once rows may start under a call's ``max_weight_staleness``: at once when the
        committed weights are at most ``max_staleness`` versions behind the newest announced
        (or the bound is None); after the open update commits when that update closes the gap.

        Raises:
            StaleWeightsError: the weights are too old and no open update would fix that (or
                the one that would was aborted). Nothing ran; the backend is usable.
            GenerationError: the backend was shut down or broke while rows waited.
        """
        if max_staleness is None:
            return
        with self._changed:
            waited = False
            while self.announced - self.version > max_staleness:
                txn = self._open
                if txn is None or self.announced - txn.version > max_staleness:
                    self.metrics.stale(refused=True, rows=rows)
                    raise self._stale_error(max_staleness)
                if not waited:
                    self.metrics.stale(refused=False, rows=rows)
                    waited = True
                self._changed.wait(timeout=1.0)
                if self.lifecycle.state in ("shut down", "broken"):
                    self.lifecycle.check_can_generate()  # says which, and what to do

    async def admit_async(self, max_staleness: int | None, rows: int = 1) -> None:
        """``admit`` without blocking the event loop: a thread waits only when rows must."""
        with self._changed:
            if max_staleness is None or self.announced - self.version <= max_staleness:
                return
        await asyncio.to_thread(self.admit, max_staleness, rows)

    def _stale_error(self, max_staleness: int) -> StaleWeightsError:
        txn = self._open
        pending = (
            f"; the update in progress (to version {txn.version}) would still leave them too old"
            if txn is not None
            else ""
        )
        return StaleWeightsError(
            f"rows would start on weights of version {self.version}, but version "
            f"{self.announced} was announced and max_weight_staleness is {max_staleness}"
            f"{pending}. Nothing ran: update the weights to version "
            f">= {self.announced - max_staleness}, then call again"
        )

    def _require_open(self, what: str) -> WeightTransaction:
        if self._open is None:
            raise WeightUpdateError(
                f"{what}() without a weight update in progress: call start_weight_update() first"
            )
        return self._open


@dataclass
class _UpdateTiming:
    """When the open update started, how long its begin and loads took, what they carried."""

    started: float = field(default_factory=time.perf_counter)
    begin_seconds: float = 0.0
    loads: LoadsInFlight = field(default_factory=LoadsInFlight)
    size: LoadSize = field(default_factory=LoadSize)


def _size(handles: Mapping[str, Any]) -> LoadSize:
    """What the handles carry, counting one place's copy (a copy per GPU is the same load)."""
    size = LoadSize()
    seen: set[str] = set()
    for bucket in handles.get("buckets", []):
        slots = [slot for slot in bucket["tensors"] if slot["name"] not in seen]
        seen.update(slot["name"] for slot in slots)
        size += LoadSize.of_slots(slots)
    return size


def _finish(loads: LoadsInFlight, wait: LoadWait) -> None:
    """Wait for a load that was handed over; it no longer runs once this returns or raises."""
    try:
        wait()
    finally:
        loads.finished()
