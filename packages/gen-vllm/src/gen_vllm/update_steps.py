"""The workers' side of a weight update: what ``GenerationBackend`` calls at each step.

A weight update is vLLM's own transaction in every worker (``start_weight_update``, loads,
``finish_weight_update``) run by this project's transfer engine (``transfer.py``);
``WeightUpdates`` holds the rules (checks before writing, completeness, version) and calls
these steps. The workers stay paused from the start of an update until the driver has verified
what every replica loaded: only then do rows paused in ``keep`` mode go on, on the new weights.
An update that ends any other way after something was written cuts those rows short, so no
token is ever sampled from weights that are part old, part new.

In a healing fleet (``fleet.py``) an update runs on the replicas serving when it began (pinned
until it ends). One that dies or does not answer within its bound (``vllm_cfg.
refit_deadline_s``) is dropped from the update and evicted (replaced; its replacement loads the
result), and the update commits on the others when they all verify. Replicas that verify
different weights still break the backend (``MixedWeightsError``): which one is right is not
known. A replacement joining the update (``Fleet.joining``) is checked against them instead: it
is admitted at the commit if it holds their weights, evicted otherwise.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gen_backend_kit.weights.updates import LoadWait
from gen_interface import (
    GenerationError,
    InFlight,
    MixedWeightsError,
    NoReplicaServingError,
    WeightBaseError,
    WeightUpdateError,
)

from gen_vllm.fleet import Fleet
from gen_vllm.receive import LoadInfo
from gen_vllm.refit import verify_update
from gen_vllm.replicas import ReplicaSet, WorkerLostError

__all__ = ["ReplicaUpdateSteps"]

logger = logging.getLogger(__name__)

_BROKEN = "this VllmGeneration is now broken: shut it down and build a new one"


class ReplicaUpdateSteps:
    """Begin, load, commit and abort on every replica of ``replicas`` (on the members of
    ``fleet`` when it heals)."""

    def __init__(self, replicas: ReplicaSet, fleet: Fleet | None = None):
        self.replicas = replicas
        self.fleet = fleet

    def begin(self, version: int, in_flight: InFlight) -> None:
        if self.fleet is not None:
            self.fleet.pin()
        try:
            members = self.replicas.member_ids()
            failed = _errors(self._survivors(members, self.replicas.start_weight_update(in_flight)))
            if failed:
                _raise_if_lost(failed)
                self.end(None, cut=False)  # the replicas that started resume as they were
                raise failed[0]
        except BaseException:
            if self.fleet is not None:
                self.fleet.unpin(None)
            raise

    def load(self, info: LoadInfo) -> LoadWait:
        """Hand one load to every replica (each runs its loads in the order handed over);
        returns the wait for it, which raises if it failed anywhere."""
        members = self.replicas.member_ids()
        outcomes = self.replicas.load_weights(info)

        def wait() -> None:
            failed = _errors(self._survivors(members, outcomes()))
            if failed:
                _raise_if_lost(failed)
                kind = (
                    WeightBaseError
                    if all(isinstance(e, WeightBaseError) for e in failed)
                    else WeightUpdateError
                )
                raise kind(f"a weight load failed on {len(failed)} replica(s): {failed[0]}")

        return wait

    def commit(self, version: int) -> None:
        """Close vLLM's transaction everywhere, verify every replica's report while the engines
        are still paused, then label the weights ``version`` and resume."""
        start = time.perf_counter()
        members = self.replicas.member_ids()
        outcomes = dict(zip(members, self.replicas.finish_weight_update()))
        # replacements joining this update are checked against the members, not with them
        joining = {r: outcomes.pop(r) for r in self.fleet.joining()} if self.fleet else {}
        if joining and not outcomes:  # none serves (every replica was lost): the joiners
            outcomes, joining = joining, {}  # verify among themselves, admitted at the commit
        try:
            reports = verify_update(self._survivors(list(outcomes), list(outcomes.values())))
        except MixedWeightsError as exc:
            raise MixedWeightsError(f"{exc}; {_BROKEN}") from exc
        if self.fleet is not None and joining:
            served = next((o for o in outcomes.values() if isinstance(o, list)), None)
            self.fleet.check_joining(joining, served)
        members = self.replicas.member_ids()
        ended = self.replicas.end_weight_update(version, cut=False)
        _raise_if_lost(_errors(self._survivors(members, ended)))
        if self.fleet is not None:
            self.fleet.unpin(version)
        logger.info(
            "committed weight version %d on %d workers in %.2f s",
            version,
            len(reports),
            time.perf_counter() - start,
        )

    def abort(self, written: bool) -> None:
        """End the update without a new version; rows paused by it are cut short when loads
        were written (their KV and their next tokens would mix old and new weights)."""
        try:
            members = self.replicas.member_ids()
            ended = self.replicas.end_weight_update(None, cut=written)
            failed = _errors(self._survivors(members, ended))
            if failed:
                logger.warning("ending an aborted weight update failed: %s", failed[0])
                _raise_if_lost(failed)
        finally:
            if self.fleet is not None:
                self.fleet.unpin(None)

    def end(self, version: int | None, *, cut: bool) -> None:
        members = self.replicas.member_ids()
        ended = self.replicas.end_weight_update(version, cut=cut)
        _raise_if_lost(_errors(self._survivors(members, ended)))

    def _survivors(self, members: list[int], outcomes: list[Any]) -> list[Any]:
        """Healing: the outcomes of the replicas that answered; one that died or did not answer
        in time is dropped from the update and evicted.

        Raises:
            NoReplicaServingError: none answered.
        """
        if self.fleet is None:
            return outcomes
        kept = []
        for replica, outcome in zip(members, outcomes):
            if isinstance(outcome, WorkerLostError):
                self.fleet.drop_from_update(replica, f"lost during a weight update: {outcome}")
            else:
                kept.append(outcome)
        if outcomes and not kept:
            raise NoReplicaServingError(
                "every replica died or did not answer during the weight update; the fleet is "
                "replacing them"
            )
        return kept


def _raise_if_lost(failed: list[GenerationError]) -> None:
    """A worker that died or stopped answering mid-update leaves its engine's weights unknown."""
    lost = [e for e in failed if isinstance(e, WorkerLostError)]
    if lost:
        raise MixedWeightsError(
            f"{lost[0]}; the weights its engine holds are unknown, so {_BROKEN}"
        ) from lost[0]


def _errors(outcomes: list[Any]) -> list[GenerationError]:
    return [o for o in outcomes if isinstance(o, GenerationError)]
