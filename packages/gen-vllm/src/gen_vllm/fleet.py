"""``Fleet``: a healing fleet of replicas: losses reported, replacements started and admitted.

The health itself is the kit's ``FleetHealth`` (one state machine, one owner); this is what
gen-vllm does at each transition:

- **Lost** (``lost``, from the router on the driver's loop: a dead stream, a failed engine, a
  wedge; or ``evict``, from a weight update that a replica did not answer): the replica is
  marked dead, its actor killed at once (Ray SIGKILLs it, even stopped), and a replacement
  starts on a thread if restarts are left (``vllm_cfg.max_replica_restarts``).
- **Replacement**: a new actor on the dead one's bundles (``ReplicaSet.start_replacement``),
  ``restarting`` until its engine is up, then ``stale``. It takes the fleet's current weights,
  not the checkpoint's: while the fleet still serves the checkpoint (no update committed) it
  already holds them; after that, a serving peer's readable copy of the committed weights
  (``vllm_cfg.weight_deltas``, ``staging.py``; the drafter model's committed tensors with it)
  is put in shared-memory buckets with their checksums and loaded through the same
  transaction as a refit (each tensor verified on arrival). A replacement on another node than
  the peer (Ray placed it elsewhere: its node was lost) gets the buckets relayed first, one at a
  time through Ray's object store, into shared memory of its own node
  (``gen_backend_kit.weights.relay``), checksums unchanged. It is admitted (``serving``, at the
  fleet's version) only when its weight report equals a serving replica's
  (``refit.weights_differ``), while no update is open; an update that committed meanwhile makes
  it load again. A replacement that fails to start, load or verify is killed and the slot is
  dead again (another replacement follows while restarts are left).
- **Updates** pin the members they started on (``pin`` / ``unpin``); a replacement waits for
  the update to end, then loads its result.

Without a copy of the committed weights, a replacement started after the first committed update
cannot take the fleet's weights from a peer. It then **joins at the next weight update**: it
stays ``stale`` (installed, never routed rows), the next update loads into it as into every
member, and at that update's commit it is admitted when its weights verify equal to the
serving replicas'. An update that does not carry every weight (an adapter or a drafter alone)
leaves it with other weights: it is evicted then, and replaced again while restarts are left.
``joining()`` lists such replicas; the collective path counts them among the ranks that take
updates (``WeightBroadcaster`` forms its group again with them). The copy costs one model's
size of host memory per worker rank (``weight_deltas``), and a peer's share one more, briefly,
while a replacement reads it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from gen_backend_kit.fleet_health import FleetHealth, ReplicaState
from gen_interface import GenerationError, MixedWeightsError

from gen_vllm.messages import UpdateReport, WorkerInfo
from gen_vllm.receive import LoadInfo
from gen_vllm.refit import weights_differ
from gen_vllm.replicas import ReplicaSet, kill_actor, translate_ray_error
from gen_vllm.router import RowRouter

__all__ = ["Fleet"]

logger = logging.getLogger(__name__)

_ATTEMPTS = 5  # loads of a replacement before giving up, when updates keep overtaking it
_POLL_S = 0.05
_NO_COPY = object()  # no serving replica keeps a readable copy of the committed weights


class Fleet:
    """Healing for ``replicas``; see the module docstring.

    Args:
        replicas: the actors (their ``members`` become the health's serving replicas).
        health: the state machine.
        loop: the driver's event loop, where the router lives.
        refit_deadline_s: the most a replacement's weight load may take.
        prepare: set a new actor up as its peers were (the copy of the committed weights,
            routing capture) before it loads weights.
        weights_absent: the fleet started without its checkpoint (``load_format: dummy``).
    """

    def __init__(
        self,
        replicas: ReplicaSet,
        health: FleetHealth,
        *,
        loop: asyncio.AbstractEventLoop,
        refit_deadline_s: float,
        prepare: Callable[[Any], None],
        weights_absent: bool = False,
    ):
        self.replicas = replicas
        self.health = health
        self.router: RowRouter | None = None
        self.version = 0  # the fleet's committed weight version
        self.faults = 0  # replicas lost
        self.heal_seconds: list[float] = []  # from each loss to its replacement's admission
        self.copies_relayed = 0  # peers' copies relayed to a replacement on another node
        self._loop = loop
        self._deadline_s = refit_deadline_s
        self._prepare = prepare
        self._checkpoint_current = True  # no update committed: the checkpoint is the weights
        self._absent = weights_absent
        self._lock = threading.RLock()  # admissions against the start of an update
        self._lost_at: dict[int, float] = {}
        self._starting: dict[int, Any] = {}  # replacement actors not yet admitted
        self._joining: set[int] = set()  # installed replacements waiting for the next update
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        replicas.members = health.serving

    # ---- losses ----------------------------------------------------------------------------

    def lost(self, replica: int, why: str) -> None:
        """``replica`` is lost (the router's ``on_lost``, on the driver's loop): dead, killed,
        and replaced if restarts are left. Nothing once the backend shuts down (its streams end
        then)."""
        if self._closed.is_set() or not self.health.kill(replica, why):
            return
        self.faults += 1
        self._lost_at[replica] = time.monotonic()
        self.replicas.kill(replica)
        logger.warning("replica %d is dead and was killed: %s", replica, why)
        self._maybe_replace(replica)

    def evict(self, replica: int, why: str) -> None:
        """Treat ``replica`` as lost from any thread (a weight update it did not answer): its
        rows move as if its stream had ended."""
        if self.router is None or self._closed.is_set():
            return
        router = self.router
        try:
            self._loop.call_soon_threadsafe(router.lose, replica, why)
        except RuntimeError:  # the loop is closed: shutting down
            return

    def _maybe_replace(self, replica: int) -> None:
        if self._closed.is_set() or not self.health.may_restart(replica):
            return
        self.health.move(replica, ReplicaState.RESTARTING, "a replacement is starting")
        thread = threading.Thread(
            target=self._replace, args=(replica,), name=f"replace-replica-{replica}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    # ---- updates ---------------------------------------------------------------------------

    def joining(self) -> list[int]:
        """Replacements that wait for the next weight update to take the fleet's weights."""
        with self._lock:
            return sorted(self._joining)

    def updated_ids(self) -> list[int]:
        """The replicas an update starts on: the members and the replacements joining."""
        with self._lock:
            return sorted({*self.replicas.member_ids(), *self._joining})

    def pin(self) -> list[int]:
        """An update starts on the members of now and the replacements joining; they stay its
        members until ``unpin``."""
        with self._lock:
            pinned = self.replicas.pinned = self.updated_ids()
            if self.router is not None:
                self.router.paused = True
            return pinned

    def drop_from_update(self, replica: int, why: str) -> None:
        """``replica`` failed its part of the update in progress: out of it, and evicted."""
        pinned = self.replicas.pinned
        if pinned is not None and replica in pinned:
            pinned.remove(replica)
        self.evict(replica, why)

    def check_joining(self, outcomes: dict[int, Any], reference: list[UpdateReport] | None) -> None:
        """At an update's commit: each joining replica's finish ``outcomes`` (its ranks'
        reports, or its error) against a serving member's (``reference``). One that holds
        other weights (or failed) is dropped from the update, killed and replaced; the rest are
        admitted at ``unpin``."""
        for replica, outcome in outcomes.items():
            why = (
                str(outcome)
                if isinstance(outcome, BaseException)
                else "no serving replica to compare with"
                if reference is None
                else weights_differ(reference, outcome)
            )
            if why is None:
                continue
            only_drafter = (
                reference is not None
                and not isinstance(outcome, BaseException)
                and weights_differ(reference, outcome, drafter=False) is None
            )
            if only_drafter:
                self._wait_for_drafter(replica, why)
                continue
            with self._lock:  # never routed rows: lost directly, not through the router
                self._joining.discard(replica)
                pinned = self.replicas.pinned
                if pinned is not None and replica in pinned:
                    pinned.remove(replica)
            self.lost(replica, f"it joined a weight update and does not hold the fleet's: {why}")

    def _wait_for_drafter(self, replica: int, why: str) -> None:
        """Joining ``replica`` took the update and holds the fleet's target weights, but not
        its drafter model (the update did not carry the drafter, which changed since the
        checkpoint): it stays joining, unrouted, for the next update, which it joins again."""
        with self._lock:
            pinned = self.replicas.pinned
            if pinned is not None and replica in pinned:
                pinned.remove(replica)
        logger.warning(
            "replica %d's replacement holds the fleet's weights but not its drafter model (%s): "
            "it serves from the next weight update that carries the drafter's",
            replica,
            why,
        )

    def unpin(self, version: int | None) -> None:
        """The update ended: committed as ``version`` on its members, or dropped (None). A
        joining replica still pinned at a commit verified (``check_joining``): admitted."""
        with self._lock:
            if version is not None:
                self.version = version
                self._checkpoint_current = False
                self._absent = False
                self.health.set_version(version)
                for replica in sorted(self._joining & set(self.replicas.pinned or ())):
                    self._joining.discard(replica)
                    self._admitted(replica, version, "at the weight update it joined")
            self.replicas.pinned = None
            if self.router is not None:
                self.router.paused = False

    # ---- replacements ----------------------------------------------------------------------

    def _replace(self, replica: int) -> None:
        while not self._closed.is_set():
            actor = None
            try:
                restarts = self.health.record(replica).restarts
                actor, info = self.replicas.start_replacement(
                    replica, restarts, lambda a: self._starting.__setitem__(replica, a)
                )
                self.health.move(replica, ReplicaState.STALE, "engine up, weights unverified")
                self._prepare(actor)
                self._admit(replica, actor, info)
                return
            except Exception as exc:
                if actor is not None:
                    kill_actor(actor)
                self._starting.pop(replica, None)
                if self._closed.is_set():
                    return
                if not self.health.replacement_failed(replica, str(exc)):
                    return

    def _admit(self, replica: int, actor: Any, info: WorkerInfo) -> None:
        """Bring ``actor`` to the fleet's weights and admit it; see the module docstring.

        Raises:
            GenerationError: a load failed, or its weights did not verify.
        """
        for _ in range(_ATTEMPTS):
            self._wait_for_no_update()
            with self._lock:
                if self.replicas.pinned is not None:
                    continue
                version = self.version
                shared = None if self._checkpoint_current else self._share_copy(version)
                if shared is _NO_COPY:  # installed under the lock: no update starts between
                    self._join_next_update(replica, actor, info, version)
                    return
            source = "its checkpoint"
            if shared is None:
                report = self._get(actor.weight_report.remote(), "a weight report")
            else:
                peer, handles = cast(tuple[int, dict[str, Any]], shared)
                source = f"replica {peer}'s copy of version {version}"
                try:
                    report = self._load_from(peer, actor, info, handles, version)
                finally:
                    self.replicas.actors[peer].release_committed_weights.remote()
            with self._lock:
                if self.replicas.pinned is not None or self.version != version:
                    continue  # an update came between: load its result
                self._verify(replica, report, source)
                self.replicas.install(replica, actor, info)
                self._starting.pop(replica, None)
                self._admitted(replica, version, f"from {source}")
                return
        raise GenerationError(
            f"weight updates kept overtaking the replacement of replica {replica} "
            f"({_ATTEMPTS} loads)"
        )

    def _admitted(self, replica: int, version: int, how: str) -> None:
        """``replica`` (installed, verified) serves at ``version`` from now on; the caller
        holds the lock."""
        self.health.admit(replica, version)
        lost_at = self._lost_at.pop(replica, None)
        if lost_at is not None:
            self.heal_seconds.append(time.monotonic() - lost_at)
        if self.router is not None:
            self._loop.call_soon_threadsafe(self.router.admit, replica)
        logger.info("replica %d replaced, serving at weight version %d %s", replica, version, how)

    def _join_next_update(self, replica: int, actor: Any, info: WorkerInfo, version: int) -> None:
        """No peer can give ``actor`` the fleet's weights: install it to join the next update
        (stale, never routed rows); the caller holds the lock and no update is open."""
        self.replicas.install(replica, actor, info)
        self._starting.pop(replica, None)
        self._joining.add(replica)
        logger.warning(
            "replica %d's replacement is up, but no serving replica keeps a readable copy of "
            "the committed weights (version %d; vllm_cfg.weight_deltas keeps one): it joins "
            "the next weight update, which must carry every weight, and serves from its commit",
            replica,
            version,
        )

    def _share_copy(self, version: int) -> tuple[int, dict[str, Any]] | object:
        """A serving peer's copy of the committed weights at ``version``, shared: ``(peer,
        handles)``; ``_NO_COPY`` when no serving replica keeps one at ``version``
        (``vllm_cfg.weight_deltas``)."""
        for peer in self.replicas.member_ids():
            shared = self._get(
                self.replicas.actors[peer].share_committed_weights.remote(), "sharing weights"
            )
            if shared is not None and shared[0] == version:
                return peer, shared[1]
            if shared is not None:
                self.replicas.actors[peer].release_committed_weights.remote()
        return _NO_COPY

    def _load_from(
        self, peer: int, actor: Any, info: WorkerInfo, handles: dict[str, Any], version: int
    ) -> list[UpdateReport]:
        """Load ``peer``'s shared copy into the new ``actor``: read in place when both run on
        one node; else relayed first to the actor's node (``relay_shared_weights``: Ray's
        object store, a bucket at a time, every checksum kept), and those segments removed
        after the load, whatever its outcome."""
        if self.replicas.infos[peer]["node_id"] == info["node_id"]:
            return self._load(actor, handles, version)
        relayed = self._get(
            actor.relay_shared_weights.remote(self.replicas.actors[peer], handles),
            "relaying a peer's weights to another node",
            self._deadline_s,
        )
        self.copies_relayed += 1
        try:
            return self._load(actor, relayed, version)
        finally:
            actor.release_relayed_weights.remote(relayed)

    def _load(self, actor: Any, handles: dict[str, Any], version: int) -> list[UpdateReport]:
        """Run a whole refit from ``handles`` on the new actor alone; its ranks' reports of
        the weights it serves once the refit ended (the drafter model takes its tensors at
        the end, after the finish's reports)."""
        actor_calls = [
            lambda: actor.start_weight_update.remote("keep"),
            lambda: actor.load_weights.remote(LoadInfo(handles=handles), 0),  # type: ignore[typeddict-item]
            lambda: actor.finish_weight_update.remote(True),
            lambda: actor.end_weight_update.remote(version, False),
        ]
        for call in actor_calls:
            self._get(call(), "a replacement's weight load", self._deadline_s)
        reports: list[UpdateReport] = self._get(actor.weight_report.remote(), "a weight report")
        return reports

    def _verify(self, replica: int, report: list[UpdateReport], source: str) -> None:
        members = self.replicas.member_ids()
        if not members or self._absent:
            return  # nothing to compare with: it holds the checkpoint, as the fleet did
        reference = self._get(
            self.replicas.actors[members[0]].weight_report.remote(), "a weight report"
        )
        why = weights_differ(reference, report)
        if why is not None:
            raise MixedWeightsError(
                f"the replacement of replica {replica}, loaded from {source}, does not hold "
                f"the weights replica {members[0]} serves (version {self.version}): {why}; "
                "evicted"
            )

    def _wait_for_no_update(self) -> None:
        deadline = time.monotonic() + self._deadline_s + self.replicas.timeouts.update_s
        while self.replicas.pinned is not None and not self._closed.is_set():
            if time.monotonic() > deadline:
                raise GenerationError("a weight update stayed open past its bounds")
            time.sleep(_POLL_S)
        if self._closed.is_set():
            raise GenerationError("the backend shut down")

    def _get(self, ref: Any, what: str, timeout_s: float | None = None) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout_s or self.replicas.timeouts.control_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise GenerationError(f"{what} did not finish within {timeout_s} s") from exc
        except Exception as exc:
            raise translate_ray_error(exc, what) from exc

    # ---- reading, closing ------------------------------------------------------------------

    def metrics(self) -> dict[str, int | float]:
        """The health's metrics, the faults seen, rows re-run or lost, and healing times."""
        router = self.router
        heal = self.heal_seconds
        return {
            **self.health.metrics(),
            "fleet_faults_total": self.faults,
            "fleet_rows_rerun_total": router.rows_rerun if router is not None else 0,
            "fleet_rows_lost_total": router.rows_lost if router is not None else 0,
            "fleet_heal_seconds_last": heal[-1] if heal else 0.0,
            "fleet_heal_seconds_max": max(heal) if heal else 0.0,
            "fleet_copies_relayed_total": self.copies_relayed,
        }

    def settled(self) -> bool:
        """No replacement is under way, nor due (unless the fleet is closed): see
        ``FleetHealth.settled``."""
        return self.health.settled(not self._closed.is_set(), self.joining())

    def wait_settled(self, timeout_s: float) -> bool:
        """Wait until no replacement is under way; whether that happened within ``timeout_s``."""
        return self.health.wait_settled(
            timeout_s, _POLL_S, closed=self._closed, waiting=self.joining
        )

    def close(self) -> None:
        """Stop replacing, and kill replacements not yet admitted (before ``ReplicaSet.
        shutdown``, which kills the members)."""
        self._closed.set()
        for actor in list(self._starting.values()):
            kill_actor(actor)
        for thread in self._threads:
            thread.join(timeout=5.0)
        for actor in list(self._starting.values()):  # one that came up while joining
            kill_actor(actor)
        self._starting.clear()
