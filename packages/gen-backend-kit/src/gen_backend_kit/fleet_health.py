"""``FleetHealth``: the one owner of a fleet of replicas' health.

A backend that runs several replicas (gen-vllm's Ray actors, gen-sglang's servers) keeps each
replica's state here and nowhere else; its router asks ``serving()`` where rows may go, its
watchdog reports what it sees, and its replacement path moves a new replica through the states
below. The metrics (``metrics()``) go into ``get_logger_metrics()``.

States and the transitions allowed (anything else raises ``IllegalTransitionError``)::

    serving    -> suspect     no progress seen for a while on rows it holds; still routed to
    serving    -> dead        its process died, its stream ended, it wedged, or it was evicted
    suspect    -> serving     progress again
    suspect    -> dead
    dead       -> restarting  a replacement is starting in its place (counts one restart)
    restarting -> stale       the replacement's engine is up; its weights are not verified yet
    restarting -> dead        the replacement failed to start
    stale      -> serving     its weights verified equal to the fleet's: admitted, at the fleet's
                              version
    stale      -> dead        its weights could not be loaded or verified

``dead`` is where a replica stays when no restart is left (``restarts_left`` 0): the fleet runs
smaller. Only ``serving`` and ``suspect`` replicas take rows and weight updates.

The membership ``epoch`` grows by one each time the set of replicas that take rows changes (a
replica leaves it or is admitted): a caller that remembers the epoch can tell that the fleet it
spoke to is not the fleet of now.

Thread-safe: the router's loop, a watchdog and a replacement thread may all report.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

__all__ = ["FleetHealth", "IllegalTransitionError", "ReplicaHealth", "ReplicaState"]

logger = logging.getLogger(__name__)


class ReplicaState(enum.IntEnum):
    """A replica's health; the value is what ``metrics()`` reports as ``replica_<i>_state``."""

    SERVING = 0
    SUSPECT = 1
    DEAD = 2
    RESTARTING = 3
    STALE = 4


_ALLOWED: dict[ReplicaState, frozenset[ReplicaState]] = {
    ReplicaState.SERVING: frozenset({ReplicaState.SUSPECT, ReplicaState.DEAD}),
    ReplicaState.SUSPECT: frozenset({ReplicaState.SERVING, ReplicaState.DEAD}),
    ReplicaState.DEAD: frozenset({ReplicaState.RESTARTING}),
    ReplicaState.RESTARTING: frozenset({ReplicaState.STALE, ReplicaState.DEAD}),
    ReplicaState.STALE: frozenset({ReplicaState.SERVING, ReplicaState.DEAD}),
}

#: The states whose replicas take rows and weight updates.
_MEMBERS = frozenset({ReplicaState.SERVING, ReplicaState.SUSPECT})


class IllegalTransitionError(RuntimeError):
    """A replica was moved between states the state machine does not connect: a bug in the
    backend's healing, never the caller's fault."""


@dataclass
class ReplicaHealth:
    """One replica's record.

    Attributes:
        state: where it is now.
        weight_version: the committed weight version it serves (None: not verified yet).
        since: ``time.monotonic()`` of its last transition.
        reason: why it last changed state (for logs and errors).
        restarts: replacements started in its place.
    """

    state: ReplicaState = ReplicaState.SERVING
    weight_version: int | None = 0
    since: float = field(default_factory=time.monotonic)
    reason: str = "started"
    restarts: int = 0


class FleetHealth:
    """The states of ``size`` replicas, all serving at ``weight_version`` at first.

    Args:
        size: replicas in the fleet at full strength.
        max_restarts: replacements the whole fleet may start over its life; past them a dead
            replica stays dead and the fleet runs smaller (``restarts_left``).
        weight_version: the version every replica serves at start.
    """

    def __init__(self, size: int, *, max_restarts: int, weight_version: int = 0):
        if size < 1:
            raise ValueError(f"a fleet needs at least one replica, got size={size}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.size = size
        self.max_restarts = max_restarts
        self.epoch = 0
        self.restarts = 0
        self._replicas = [ReplicaHealth(weight_version=weight_version) for _ in range(size)]
        self._lock = threading.Lock()
        self._warned_smaller = False

    # ---- reading ---------------------------------------------------------------------------

    def state(self, replica: int) -> ReplicaState:
        return self._replicas[replica].state

    def record(self, replica: int) -> ReplicaHealth:
        """A copy of ``replica``'s record."""
        with self._lock:
            r = self._replicas[replica]
            return ReplicaHealth(r.state, r.weight_version, r.since, r.reason, r.restarts)

    def serving(self) -> list[int]:
        """The replicas that take rows and weight updates (serving or suspect), in order."""
        with self._lock:
            return [i for i, r in enumerate(self._replicas) if r.state in _MEMBERS]

    def takes_rows(self, replica: int) -> bool:
        return self._replicas[replica].state in _MEMBERS

    @property
    def restarts_left(self) -> int:
        return max(0, self.max_restarts - self.restarts)

    def count(self, state: ReplicaState) -> int:
        with self._lock:
            return sum(r.state is state for r in self._replicas)

    # ---- transitions -----------------------------------------------------------------------

    def move(self, replica: int, to: ReplicaState, reason: str) -> bool:
        """Move ``replica`` to ``to``; returns False when it is there already (reports of one
        failure often arrive twice: a dead stream and a failed call).

        Raises:
            IllegalTransitionError: the state machine has no such transition.
        """
        return self._move(replica, to, reason, None)

    def _move(
        self, replica: int, to: ReplicaState, reason: str, weight_version: int | None
    ) -> bool:
        """``move``, setting the replica's ``weight_version`` in the same step when given (an
        admission: no reader sees it serving without its version)."""
        with self._lock:
            record = self._replicas[replica]
            if record.state is to:
                return False
            if to not in _ALLOWED[record.state]:
                raise IllegalTransitionError(
                    f"replica {replica} cannot go from {record.state.name.lower()} to "
                    f"{to.name.lower()} ({reason}); allowed: "
                    f"{sorted(s.name.lower() for s in _ALLOWED[record.state])}"
                )
            was_member = record.state in _MEMBERS
            record.state, record.reason, record.since = to, reason, time.monotonic()
            if to is ReplicaState.RESTARTING:
                record.restarts += 1
                self.restarts += 1
            if to not in _MEMBERS:
                record.weight_version = None  # what it holds is unknown until verified
            elif weight_version is not None:
                record.weight_version = weight_version
            if was_member != (to in _MEMBERS):
                self.epoch += 1
        logger.info("replica %d: %s (%s)", replica, to.name.lower(), reason)
        return True

    def kill(self, replica: int, reason: str) -> bool:
        """``replica`` is dead, from whichever state it was in (a replacement that dies while
        it starts or loads, a serving one that dies). False when it was dead already."""
        with self._lock:
            already = self._replicas[replica].state is ReplicaState.DEAD
        return False if already else self.move(replica, ReplicaState.DEAD, reason)

    def may_restart(self, replica: int) -> bool:
        """Whether a replacement may start for dead ``replica``; warns once when the fleet has
        used up its restarts and so runs smaller."""
        if self.state(replica) is not ReplicaState.DEAD:
            return False
        if self.restarts_left > 0:
            return True
        if not self._warned_smaller:
            self._warned_smaller = True
            logger.warning(
                "the fleet used its %d replica restarts (max_replica_restarts): dead replicas "
                "stay dead and it runs with %d of %d replicas",
                self.max_restarts,
                len(self.serving()),
                self.size,
            )
        return False

    def admit(self, replica: int, weight_version: int) -> None:
        """A stale replica's weights verified equal to the fleet's: it serves at
        ``weight_version``.

        Raises:
            IllegalTransitionError: it is not stale.
        """
        self._move(
            replica,
            ReplicaState.SERVING,
            f"admitted at weight version {weight_version}",
            weight_version,
        )

    def set_version(self, weight_version: int) -> None:
        """An update committed on every member: they all serve ``weight_version`` now."""
        with self._lock:
            for record in self._replicas:
                if record.state in _MEMBERS:
                    record.weight_version = weight_version

    def replacement_failed(self, replica: int, reason: str) -> bool:
        """A replacement of ``replica`` failed (``reason``): it is dead again. Returns True when
        another may start (the replica is then restarting), False when restarts are spent."""
        self.kill(replica, f"its replacement failed: {reason}")
        logger.warning("the replacement of replica %d failed: %s", replica, reason)
        if not self.may_restart(replica):
            return False
        self.move(replica, ReplicaState.RESTARTING, "another replacement")
        return True

    def settled(self, replacements_due: bool = True, waiting: Collection[int] = ()) -> bool:
        """No replacement is under way (a replica restarting or stale), nor due: a dead replica
        while restarts are left gets one (a loss, or a replacement's failure, is dead for a
        moment before the next replacement starts). ``replacements_due`` False: the owner
        replaces no more (it closed), so a dead replica stays dead. ``waiting``: stale replicas
        that wait for something outside the fleet (the next weight update), not under way."""
        with self._lock:
            states = [record.state for record in self._replicas]
            restarts_left = self.restarts_left
        if any(
            s is ReplicaState.RESTARTING or (s is ReplicaState.STALE and i not in waiting)
            for i, s in enumerate(states)
        ):
            return False
        due = ReplicaState.DEAD in states and restarts_left > 0
        return not (due and replacements_due)

    def wait_settled(
        self,
        timeout_s: float,
        poll_s: float = 0.05,
        closed: threading.Event | None = None,
        waiting: Callable[[], Collection[int]] = tuple,
    ) -> bool:
        """Wait until ``settled`` (with replacements due until ``closed`` is set, and the stale
        replicas ``waiting()`` names not under way); whether that happened within
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.settled(closed is None or not closed.is_set(), waiting()):
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        return True

    def metrics(self) -> dict[str, int | float]:
        """``fleet_*`` counts and each replica's state (``ReplicaState`` values) and weight
        version (-1: none verified), for ``get_logger_metrics()``."""
        with self._lock:
            records = list(self._replicas)
            out: dict[str, int | float] = {
                f"fleet_replicas_{state.name.lower()}": sum(r.state is state for r in records)
                for state in ReplicaState
            }
            out["fleet_size"] = self.size
            out["fleet_epoch"] = self.epoch
            out["fleet_restarts_total"] = self.restarts
            out["fleet_restarts_left"] = self.restarts_left
            for i, r in enumerate(records):
                out[f"replica_{i}_state"] = int(r.state)
                out[f"replica_{i}_weight_version"] = (
                    -1 if r.weight_version is None else r.weight_version
                )
            return out
