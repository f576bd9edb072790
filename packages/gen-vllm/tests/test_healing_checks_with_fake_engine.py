"""The testkit's healing checks (``gen_testkit.suite.healing``) against the real backend's fleet
on the fake engine: two replicas, a lost replica's worker SIGKILLed."""

from __future__ import annotations

import os
import signal

import pytest
from gen_testkit.conformance import ConformanceSubject
from gen_testkit.suite.healing import RESTARTS_NEEDED, HealingChecks


class KilledWorkers:
    """``ReplicaFaults`` for ``VllmGeneration``: a replica is lost when its worker is
    SIGKILLed; it holds rows while its engine does."""

    def __init__(self, backend):
        self.backend = backend

    def holds_rows(self, replica: int) -> bool:
        members = self.backend.replicas.member_ids()
        return dict(zip(members, self.backend.rows_in_flight())).get(replica, 0) > 0

    def lose_replica(self, replica: int) -> None:
        os.kill(self.backend.replicas.infos[replica]["pid"], signal.SIGKILL)


class TestVllmFleetHealing(HealingChecks):
    heal_timeout_s = 240.0  # a replacement's start on two busy cores

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, fake_engine_shipped, tmp_path_factory, tiny_qwen2):
        from fake_backends import FakeBackends

        made = FakeBackends(fake_engine_shipped, tmp_path_factory.mktemp("healing_checks"))
        # weight_deltas: the copy of the committed weights a replacement takes after a refit
        backend = made.backend(
            made.cluster([2]),
            tiny_qwen2,
            weight_deltas=True,
            max_replica_restarts=RESTARTS_NEEDED,
        )
        yield ConformanceSubject.for_model(backend, tiny_qwen2)
        made.close()

    @pytest.fixture(scope="class")
    @classmethod
    def replica_faults(cls, subject):
        return KilledWorkers(subject.backend)
