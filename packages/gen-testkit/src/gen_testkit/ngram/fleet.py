"""``NgramFleet``: n-gram replicas behind one ``GenerationInterface``, a fleet that heals.

The testkit's reference for ``gen_testkit.suite.healing``: what a healing backend does, small
enough to read in one sitting. Its health is the kit's ``FleetHealth`` (states, epoch,
restarts, ``fleet_*`` and ``replica_<i>_*`` metrics).

- **Rows** of a call are spread round-robin over the serving replicas (row r of the call to
  the r mod n-th of the n serving), each replica's share decoding on its own thread. A row's
  tokens depend only on its prompt, settings, seed and the weights, so it gives the same result
  on any replica holding the fleet's weights.
- **A loss** (``lose_replica``, the fault-injection hook; a crashed worker): the replica is dead
  at once and drops what it was doing. Its rows that had finished stand; the others run again
  from their prompts and seeds on the replicas serving then (``fleet_rows_rerun_total``), so
  the call returns what a call without the fault returns. A row that had already streamed
  tokens to the caller cannot be taken back: the call ends with ``RowLostError`` naming it.
  No replica serving: ``NoReplicaServingError``.
- **A replacement** starts on a thread while restarts are left (``max_restarts``):
  ``restarting`` while a new replica is built from the config (the checkpoint's weights), then
  ``stale``; it waits until no weight update is open, takes a serving peer's weights, and is
  admitted (``serving``, at the fleet's version) only when the checksum of everything it holds
  equals the peer's. With no peer serving it keeps the checkpoint's weights, which are the
  fleet's only while no update has committed; after one it cannot be verified and the slot
  stays dead (the fleet runs smaller).
- **Weight updates** run on the replicas serving when the update starts (each one's own steps:
  its gate pauses or cuts its rows, its loads are verified), and commit on those still alive.

Single process, CPU only. Not a registered backend: build it directly, from an ``NgramConfig``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
from gen_backend_kit import GenerationCall, RowResult
from gen_backend_kit.backend import GenerationBackend
from gen_backend_kit.fleet_health import FleetHealth, ReplicaState
from gen_backend_kit.scoring import ScoreBatch, ScoredRow
from gen_backend_kit.stepping import RowControl
from gen_interface import (
    BackendCapabilities,
    GenerationError,
    InFlight,
    MixedWeightsError,
    NoReplicaServingError,
    RowLostError,
)
from gen_interface.weights import weights_checksum

from gen_testkit.ngram.backend import NgramConfig, NgramGeneration

__all__ = ["NgramFleet"]

logger = logging.getLogger(__name__)


@dataclass
class _Share:
    """The rows of one call that one replica runs: ``rows`` are the call's indices."""

    replica: int
    rows: list[int]
    control: RowControl = field(default_factory=RowControl)
    lost: bool = False


class _FleetState:
    """What every ``with_sampling`` front end of one fleet shares."""

    def __init__(self, replicas: list[NgramGeneration], health: FleetHealth):
        self.replicas = replicas
        self.health = health
        self.lock = threading.Condition()  # shares, admissions and the update's members
        self.shares: dict[int, list[_Share]] = {i: [] for i in range(len(replicas))}
        self.updating: list[int] | None = None  # the members of the open update
        self.admitting = False  # a replacement is taking the fleet's weights
        self.version = 0  # the fleet's committed weight version
        self.checkpoint_current = True  # no update committed: the checkpoint is the weights
        self.checkpoint_checksum = weights_checksum(replicas[0].model.weights.items())
        self.faults = 0
        self.rows_rerun = 0
        self.threads: list[threading.Thread] = []
        self.closed = threading.Event()


class NgramFleet(GenerationBackend):
    """A healing fleet of ``NgramGeneration`` replicas; see the module docstring.

    The fault-injection hook of ``gen_testkit.suite.healing.ReplicaFaults``: ``holds_rows``,
    ``lose_replica``.
    """

    config_schema: ClassVar[type] = NgramConfig

    def __init__(self, config: NgramConfig, *, replicas: int = 2, max_restarts: int = 16):
        """``config`` is each replica's (``NgramGeneration``'s; its ``backend`` stays
        ``"ngram"``): ``replicas`` of them, ``max_restarts`` replacements over the fleet's life.
        """
        if replicas < 1:
            raise ValueError(f"a fleet needs at least one replica, got replicas={replicas}")
        config = cast(NgramConfig, self.complete_config(config))
        self._replica_config = config
        members = [NgramGeneration(config) for _ in range(replicas)]
        health = FleetHealth(replicas, max_restarts=max_restarts)
        self._fleet = _FleetState(members, health)
        first = members[0]
        super().__init__(
            config,
            vocab_size=first.vocab_size,
            context_limit=first.context_limit,
            has_tokenizer=False,
            model_specs=first.model.specs(),
        )

    @property
    def capabilities(self) -> BackendCapabilities:
        """A replica's, with a note that this is a fleet."""
        one = self._fleet.replicas[0].capabilities
        note = "a fleet of n-gram replicas that heals (the testkit's reference)"
        return dataclasses.replace(one, notes=(*one.notes, note))

    @property
    def health(self) -> FleetHealth:
        """The fleet's state machine."""
        return self._fleet.health

    # ---- the fault-injection hook ----------------------------------------------------------

    def holds_rows(self, replica: int) -> bool:
        """Whether ``replica`` runs rows of a call now."""
        with self._fleet.lock:
            return any(not share.lost for share in self._fleet.shares[replica])

    def lose_replica(self, replica: int) -> None:
        """``replica`` fails now, as a crashed worker would: dead, its running rows dropped
        (they run again elsewhere), a replacement started while restarts are left. Returns at
        once; nothing when it is not serving."""
        fleet = self._fleet
        with fleet.lock:
            if not fleet.health.takes_rows(replica) or fleet.closed.is_set():
                return
            fleet.health.kill(replica, "lost (lose_replica)")
            fleet.faults += 1
            for share in fleet.shares[replica]:
                share.lost = True
                share.control.cancelled.set()
            if fleet.updating is not None and replica in fleet.updating:
                fleet.updating.remove(replica)
        # rows paused by an open update, or waiting for the next step, end at once
        fleet.replicas[replica].gate.reopen(None, cut=True)
        logger.warning("replica %d is lost", replica)
        if fleet.health.may_restart(replica):
            fleet.health.move(replica, ReplicaState.RESTARTING, "a replacement is starting")
            thread = threading.Thread(
                target=self._replace, args=(replica,), name=f"replace-{replica}", daemon=True
            )
            fleet.threads.append(thread)
            thread.start()

    # ---- generation ------------------------------------------------------------------------

    def _run_rows(self, call: GenerationCall, control: RowControl) -> Sequence[RowResult | None]:
        fleet = self._fleet
        results: list[RowResult | None] = [None] * call.size
        streamed: set[int] = set()  # rows that handed tokens to the caller
        pending = list(range(call.size))
        rerun = False
        while pending and not control.cancelled.is_set():
            members = fleet.health.serving()
            if not members:
                raise NoReplicaServingError(
                    f"no replica of the fleet serves ({len(pending)} rows waiting): every one "
                    "was lost and replacements are not ready; retry later"
                )
            if rerun:
                lost = sorted(streamed.intersection(pending))
                if lost:
                    raise RowLostError(
                        f"row(s) {lost} had streamed tokens when their replica was lost: "
                        "run those rows again",
                        tuple(lost),
                    )
                with fleet.lock:
                    fleet.rows_rerun += len(pending)
            shares = [
                _Share(replica, pending[k :: len(members)])
                for k, replica in enumerate(members)
                if pending[k :: len(members)]
            ]
            self._run_shares(call, control, shares, results, streamed, rerun)
            pending = [i for i in pending if results[i] is None]
            rerun = True
        return results

    def _run_shares(
        self,
        call: GenerationCall,
        control: RowControl,
        shares: list[_Share],
        results: list[RowResult | None],
        streamed: set[int],
        rerun: bool,
    ) -> None:
        """Run each share on its replica, on a thread each; raises the first error of a share
        whose replica was not lost."""
        fleet = self._fleet
        errors: list[BaseException] = []

        def run(share: _Share) -> None:
            rows = share.rows

            def on_row(j: int, result: RowResult) -> None:
                with fleet.lock:
                    if share.lost:
                        return  # a lost replica's reports are dropped
                    results[rows[j]] = control.finished(rows[j], result)

            def on_token(j: int, *token: Any) -> None:
                with fleet.lock:
                    if share.lost or control.on_token is None:
                        return
                    streamed.add(rows[j])
                    control.on_token(rows[j], *token)

            share.control.on_row = on_row
            share.control.on_token = on_token if control.on_token is not None else None
            replica = fleet.replicas[share.replica]
            try:
                replica._run_rows(self._share_call(call, rows, rerun), share.control)
            except BaseException as exc:
                if not share.lost:
                    errors.append(exc)

        with fleet.lock:
            shares = [s for s in shares if fleet.health.takes_rows(s.replica)]
            for share in shares:
                fleet.shares[share.replica].append(share)
        threads = [
            threading.Thread(target=run, args=(s,), name=f"replica-{s.replica}-rows", daemon=True)
            for s in shares
        ]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.05)
                    if control.cancelled.is_set():
                        for share in shares:
                            share.control.cancelled.set()
        finally:
            with fleet.lock:
                for share in shares:
                    fleet.shares[share.replica].remove(share)
        if errors:
            raise errors[0]

    def _share_call(self, call: GenerationCall, rows: list[int], rerun: bool) -> GenerationCall:
        """The call a replica runs for ``rows`` (each keeps its own sampling and seed, on a
        first run or a re-run alike)."""
        return GenerationCall(call.prompts.select(rows), call.sampling.select(rows))

    def _score_rows(self, batch: ScoreBatch, top_logprobs: int) -> list[ScoredRow]:
        members = self._fleet.health.serving()
        if not members:
            raise NoReplicaServingError("no replica of the fleet serves; retry later")
        return self._fleet.replicas[members[0]]._score_rows(batch, top_logprobs)

    # ---- weight updates: each member's own steps --------------------------------------------

    def _members(self) -> list[NgramGeneration]:
        """The replicas of the open update that are still alive."""
        fleet = self._fleet
        with fleet.lock:
            pinned = list(fleet.updating or [])
        return [fleet.replicas[i] for i in pinned if fleet.health.takes_rows(i)]

    def _loading_members(self) -> list[NgramGeneration]:
        """The replicas each load of the open update is written to."""
        return self._members()

    def _begin_update(self, version: int, in_flight: InFlight) -> None:
        fleet = self._fleet
        with fleet.lock:
            while fleet.admitting:  # a replacement takes the weights of now first
                fleet.lock.wait(0.05)
            fleet.updating = fleet.health.serving()
        for replica in self._members():
            replica._begin_update(version, in_flight)

    def _load_handles(self, handles: Mapping[str, Any]) -> None:
        for replica in self._loading_members():
            replica._load_handles(handles)

    def _write_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        for replica in self._loading_members():
            replica._write_state_dict(state_dict)

    def _commit_update(self, version: int) -> None:
        fleet = self._fleet
        for replica in self._members():
            replica._commit_update(version)
        with fleet.lock:
            fleet.version = version
            fleet.checkpoint_current = False
            fleet.health.set_version(version)
            fleet.updating = None
            fleet.lock.notify_all()

    def _abort_update(self, written: bool) -> None:
        fleet = self._fleet
        for replica in self._members():
            replica._abort_update(written)
        with fleet.lock:
            fleet.updating = None
            fleet.lock.notify_all()

    def _restore_weights(self) -> bool:
        restored = [replica._restore_weights() for replica in self._members()]
        return all(restored)

    # ---- replacements ------------------------------------------------------------------------

    def _replace(self, index: int) -> None:
        fleet = self._fleet
        while not fleet.closed.is_set():
            try:
                replacement = NgramGeneration(self._replica_config)
                fleet.health.move(index, ReplicaState.STALE, "built, weights unverified")
                self._admit(index, replacement)
                return
            except Exception as exc:
                if fleet.closed.is_set():
                    return
                if not fleet.health.replacement_failed(index, str(exc)):
                    return

    def _admit(self, index: int, replacement: NgramGeneration) -> None:
        """Give ``replacement`` the fleet's weights, verify them, and admit it in place of
        replica ``index``; no update opens meanwhile.

        Raises:
            GenerationError: there are no weights to verify against.
            MixedWeightsError: its weights differ from the fleet's after the copy.
        """
        fleet = self._fleet
        with fleet.lock:
            while fleet.updating is not None and not fleet.closed.is_set():
                fleet.lock.wait(0.05)
            if fleet.closed.is_set():
                raise GenerationError("the fleet shut down")
            fleet.admitting = True
            peers = fleet.health.serving()
        try:
            # no fleet lock here: a peer's decode thread may hold its gate's lock and wait on it
            if peers:
                peer = fleet.replicas[peers[0]]
                source = f"replica {peers[0]}"
                weights = peer.state_dict()
                replacement._write_state_dict(weights)
                expected = weights_checksum(weights.items())
            elif fleet.checkpoint_current:
                source, expected = "the checkpoint", fleet.checkpoint_checksum
            else:
                raise GenerationError(
                    f"no replica serves to copy weight version {fleet.version} from, and the "
                    "checkpoint is not the fleet's weights any more: the fleet runs smaller"
                )
            held = weights_checksum(replacement.state_dict().items())
            if held != expected:
                raise MixedWeightsError(
                    f"the replacement of replica {index} does not hold the weights of {source} "
                    f"(checksum {held:#x}, expected {expected:#x}); not admitted"
                )
            self._install(index, replacement)
        finally:
            with fleet.lock:
                fleet.admitting = False
                fleet.lock.notify_all()

    def _install(self, index: int, replacement: NgramGeneration) -> None:
        """Put ``replacement`` in place of replica ``index``, serving at the fleet's version."""
        fleet = self._fleet
        replacement.gate.reopen(fleet.version)  # the version its tokens report
        with fleet.lock:
            old = fleet.replicas[index]
            fleet.replicas[index] = replacement
            fleet.health.admit(index, fleet.version)
        old.shutdown()
        logger.info("replica %d replaced, serving at weight version %d", index, fleet.version)

    # ---- metrics, closing --------------------------------------------------------------------

    def _extra_metrics(self, clear: bool = False) -> dict[str, int | float]:
        fleet = self._fleet
        with fleet.lock:
            if clear:
                fleet.rows_rerun = 0
                fleet.faults = 0
            return {
                **fleet.health.metrics(),
                "fleet_faults_total": fleet.faults,
                "fleet_rows_rerun_total": fleet.rows_rerun,
            }

    def _close(self) -> None:
        fleet = self._fleet
        fleet.closed.set()
        with fleet.lock:
            fleet.lock.notify_all()
        for thread in fleet.threads:
            thread.join(timeout=5.0)
        for replica in fleet.replicas:
            replica.shutdown()
