"""The life cycle every backend shares: ready, finished, shut down, broken, and what is asleep.

A backend owns one ``Lifecycle`` and gives it three hooks: how to wake resources (``wake``), how
to release what generation holds (``release``), and how to free everything (``close``). Its
``prepare_for_generation``, ``finish_generation`` and ``shutdown`` are then one line each, and
every ``generate``, ``score`` and weight update enters through ``generating()`` or
``updating_weights()``, which refuse with the same messages on every backend. A ``with_sampling``
front end holds a ``view()`` of its owner's lifecycle: the same state, its own ``shutdown``.

States::

    ready --finish()--> finished --prepare()--> ready          (prepare wakes what is asleep)
      any --shutdown()--> shut down                             (final; idempotent)
      ready/finished --mark_broken(reason)--> broken            (final until shutdown)

Resources (``"weights"``, ``"kv_cache"``) are what ``finish`` may put to sleep. ``prepare(tags)``
wakes the named ones (weights first); the backend is ready once nothing is asleep. A weight
update while the weights are asleep wakes the weights only, so the update writes into live
memory, and leaves the KV cache asleep until ``prepare`` (the order of NeMo RL's refit:
``prepare(tags=["weights"])``, update, ``prepare(tags=["kv_cache"])``).

Weights can also be *absent*: an engine started without reading its checkpoint, or weights
discarded by a deep sleep. ``generate`` then refuses until a weight update commits
(``weights_arrived()``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

from gen_interface.errors import (
    BackendBrokenError,
    GenerationError,
    GenerationInputError,
    WeightsAbsentError,
    WeightUpdateError,
)

__all__ = [
    "DUMMY_WEIGHTS",
    "RESOURCES",
    "Lifecycle",
    "LifecycleView",
    "Resource",
    "State",
    "close_all",
]

logger = logging.getLogger(__name__)

State = Literal["ready", "finished", "shut down", "broken"]
Resource = Literal["weights", "kv_cache"]

#: Every resource, in the order they are woken (weights before the cache that depends on them).
RESOURCES: tuple[Resource, ...] = ("weights", "kv_cache")


#: ``weights_absent`` of a backend started without reading its checkpoint (``load_format:
#: dummy``, ``configure_generation_config(..., is_eval=False)``).
DUMMY_WEIGHTS = (
    "it started with load_format 'dummy', without reading the checkpoint; the first weight "
    "update brings the weights"
)


def _nothing_to_wake(resources: tuple[Resource, ...]) -> None:
    return None


def _nothing_asleep() -> frozenset[Resource]:
    return frozenset()


def _nothing_to_close() -> None:
    return None


class Lifecycle:
    """One backend's state, shared by its ``with_sampling`` front ends.

    Args:
        name: the backend's name in messages, e.g. ``"VllmGeneration"``.
        wake: brings back the given resources (asleep now), in the order given.
        release: frees what generation holds (caches, device memory); returns what is now
            asleep. Default: nothing is released.
        close: frees everything the backend owns; called once, by the first ``shutdown``.
        weights_absent: why the backend has no real weights yet (e.g. started without reading
            the checkpoint), or None when it has them.

    Hooks run under the lifecycle's lock, so transitions never interleave.
    """

    def __init__(
        self,
        name: str,
        *,
        wake: Callable[[tuple[Resource, ...]], None] = _nothing_to_wake,
        release: Callable[[], frozenset[Resource]] = _nothing_asleep,
        close: Callable[[], None] = _nothing_to_close,
        weights_absent: str | None = None,
    ):
        self.name = name
        self._wake = wake
        self._release = release
        self._close = close
        self._lock = threading.RLock()
        self._state: State = "ready"
        self._asleep: set[Resource] = set()
        self._released: frozenset[Resource] = frozenset()
        self._broken_reason = ""
        self._weights_absent = weights_absent
        self._generating = 0
        self._updating = 0

    # ---- reading -------------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def asleep(self) -> frozenset[Resource]:
        """Resources released by ``finish`` and not woken since."""
        return frozenset(self._asleep)

    @property
    def weights_absent(self) -> str | None:
        """Why there are no real weights to generate with, or None."""
        return self._weights_absent

    def view(self) -> LifecycleView:
        """A front end's handle: this lifecycle's state, with a ``shutdown`` of its own."""
        return LifecycleView(self)

    # ---- transitions ---------------------------------------------------------------------

    def prepare(self, tags: Iterable[str] | None = None) -> None:
        """Wake the resources named by ``tags`` (all when None); ready once nothing sleeps.

        Raises:
            GenerationInputError: a tag is not ``"weights"`` or ``"kv_cache"``.
            GenerationError: the backend is shut down or broken.
        """
        wanted = _resources(tags)
        with self._lock:
            self._refuse_if_final(GenerationError)
            to_wake = tuple(r for r in RESOURCES if r in wanted and r in self._asleep)
            if to_wake:
                self._wake(to_wake)
                self._asleep.difference_update(to_wake)
            if not self._asleep:
                self._state = "ready"

    def finish(self) -> None:
        """Release what generation holds. A no-op unless ready.

        Raises:
            GenerationError: generate calls or a weight update are still running.
        """
        with self._lock:
            if self._state != "ready":
                return
            if self._generating or self._updating:
                raise GenerationError(
                    f"finish_generation() called while {self._generating} generate call(s) and "
                    f"{self._updating} weight update(s) of this {self.name} are running: finish "
                    "after they return (close async iterators you stop reading)"
                )
            self._released = self._release()
            self._asleep = set(self._released)
            self._state = "finished"

    def shutdown(self) -> None:
        """Free everything, once. Idempotent; works in every state. The state is shut down
        even when ``close`` raises (it should free what it can first: ``close_all``)."""
        with self._lock:
            if self._state == "shut down":
                return
            self._state = "shut down"
            self._close()

    def mark_broken(self, reason: str) -> None:
        """Refuse every further call but ``shutdown``: the backend cannot be trusted now."""
        with self._lock:
            if self._state != "shut down":
                self._state = "broken"
                self._broken_reason = reason

    @contextmanager
    def breaks_on_fatal(self) -> Iterator[None]:
        """A ``BackendBrokenError`` raised inside marks the backend broken, then propagates."""
        try:
            yield
        except BackendBrokenError as exc:
            self.mark_broken(str(exc))
            raise

    def weights_arrived(self) -> None:
        """A weight update committed: real weights are in place."""
        with self._lock:
            self._weights_absent = None

    def weights_discarded(self, reason: str) -> None:
        """The weights are gone (e.g. a deep sleep); generate refuses until an update commits."""
        with self._lock:
            self._weights_absent = reason

    # ---- guarded sections ----------------------------------------------------------------

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Enter a ``generate`` or ``score`` call.

        Raises:
            GenerationError: the backend is not ready, has no real weights, is shut down or
                broken; the message says what to call.
        """
        with self._lock:
            self.check_can_generate()
            self._generating += 1
        try:
            yield
        finally:
            with self._lock:
                self._generating -= 1

    @contextmanager
    def updating_weights(self) -> Iterator[None]:
        """Enter a weight update; the weights are woken first if they are asleep.

        Raises:
            WeightUpdateError: the backend is shut down or broken.
        """
        self.begin_update()
        try:
            yield
        finally:
            self.end_update()

    def begin_update(self) -> None:
        """``updating_weights`` for an update that spans several calls (a transaction)."""
        with self._lock:
            self._refuse_if_final(WeightUpdateError)
            if "weights" in self._asleep:
                self._wake(("weights",))
                self._asleep.discard("weights")
            self._updating += 1

    def end_update(self) -> None:
        with self._lock:
            self._updating -= 1

    def check_open(self, error: type[GenerationError]) -> None:
        """Raise ``error`` when the backend is shut down or broken."""
        self._refuse_if_final(error)

    def check_can_generate(self) -> None:
        """Raise ``GenerationError`` saying what to do unless generation may run now."""
        self._refuse_if_final(GenerationError)
        if self._state == "finished":
            woken_in_part = self._asleep and self._asleep != self._released
            asleep = [r for r in RESOURCES if r in self._asleep]
            raise GenerationError(
                "generate called after finish_generation(); call prepare_for_generation() first"
                + (
                    f" ({asleep} still asleep: prepare_for_generation(tags={asleep}))"
                    if woken_in_part
                    else ""
                )
            )
        if self._weights_absent is not None:
            raise WeightsAbsentError(
                f"this {self.name} has no real weights yet ({self._weights_absent}): generate "
                "after the first weight update (update_weights_from_ipc_handles or a refit)"
            )

    def _refuse_if_final(self, error: type[GenerationError]) -> None:
        if self._state == "shut down":
            raise error(f"this {self.name} is shut down; build a new one")
        if self._state == "broken":
            raise error(
                f"this {self.name} is broken ({self._broken_reason}); shut it down and build a "
                "new one"
            )


class LifecycleView:
    """A ``with_sampling`` front end's lifecycle: its owner's state, and a ``shutdown`` that only
    closes this front end (the owner and its other front ends keep running)."""

    def __init__(self, owner: Lifecycle):
        self.owner = owner
        self._closed = False

    @property
    def state(self) -> State:
        return "shut down" if self._closed else self.owner.state

    @property
    def asleep(self) -> frozenset[Resource]:
        return self.owner.asleep

    @property
    def weights_absent(self) -> str | None:
        return self.owner.weights_absent

    def view(self) -> LifecycleView:
        return self.owner.view()

    def mark_broken(self, reason: str) -> None:
        self.owner.mark_broken(reason)

    def breaks_on_fatal(self) -> contextlib.AbstractContextManager[None]:
        return self.owner.breaks_on_fatal()

    def weights_arrived(self) -> None:
        self.owner.weights_arrived()

    def weights_discarded(self, reason: str) -> None:
        self.owner.weights_discarded(reason)

    def prepare(self, tags: Iterable[str] | None = None) -> None:
        self._refuse_if_closed(GenerationError)
        self.owner.prepare(tags)

    def finish(self) -> None:
        if not self._closed:
            self.owner.finish()

    def shutdown(self) -> None:
        self._closed = True

    @contextmanager
    def generating(self) -> Iterator[None]:
        self._refuse_if_closed(GenerationError)
        with self.owner.generating():
            yield

    @contextmanager
    def updating_weights(self) -> Iterator[None]:
        self._refuse_if_closed(WeightUpdateError)
        with self.owner.updating_weights():
            yield

    def begin_update(self) -> None:
        self._refuse_if_closed(WeightUpdateError)
        self.owner.begin_update()

    def end_update(self) -> None:
        self.owner.end_update()

    def check_open(self, error: type[GenerationError]) -> None:
        self._refuse_if_closed(error)
        self.owner.check_open(error)

    def check_can_generate(self) -> None:
        self._refuse_if_closed(GenerationError)
        self.owner.check_can_generate()

    def _refuse_if_closed(self, error: type[GenerationError]) -> None:
        if self._closed:
            raise error(
                f"this with_sampling front end of a {self.owner.name} is shut down; its owner "
                "and other front ends still run"
            )


def _resources(tags: Iterable[str] | None) -> frozenset[Resource]:
    if tags is None:
        return frozenset(RESOURCES)
    given = [tags] if isinstance(tags, str) else list(tags)
    unknown = sorted(set(given) - set(RESOURCES))
    if unknown:
        raise GenerationInputError(
            f"prepare_for_generation tags must be among {list(RESOURCES)}, got {unknown}"
        )
    return frozenset(t for t in RESOURCES if t in given)


def close_all(name: str, steps: Sequence[tuple[str, Callable[[], object]]]) -> None:
    """Run every step of a shutdown, in order, even when earlier ones fail.

    Args:
        name: the backend's name, for messages.
        steps: ``(what it frees, how)`` pairs.

    Raises:
        GenerationError: after every step ran, naming the steps that failed and why.
    """
    failures = []
    for what, step in steps:
        try:
            step()
        except Exception as exc:  # the next step must run whatever went wrong here
            logger.warning("shutting down %s: freeing %s failed: %r", name, what, exc)
            failures.append(f"{what}: {type(exc).__name__}: {exc}")
    if failures:
        raise GenerationError(
            f"{name} shut down, but freeing some of what it held failed: " + "; ".join(failures)
        )
