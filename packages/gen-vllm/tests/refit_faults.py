"""A replica lost in the middle of a refit, for the healing tests on fake and real engines."""

from __future__ import annotations

import os
import signal
import time

from gen_backend_kit.fleet_health import ReplicaState
from processes import wait_dead


class KillBeforeCommit:
    """``backend``, except that its next commit first SIGKILLs ``replica``'s worker (every load
    written, the transaction open) and waits until that replica's replacement engine is up
    (``stale``), so the replacement meets the open update.

    Attributes:
        killed: the pid of the worker it killed (None before the commit).
    """

    def __init__(self, backend, replica: int, *, settle_s: float = 240.0):
        self._backend = backend
        self._replica = replica
        self._settle_s = settle_s
        self.killed: int | None = None

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def commit_weight_update(self) -> int:
        backend, replica = self._backend, self._replica
        pid = backend.replicas.infos[replica]["pid"]
        os.kill(pid, signal.SIGKILL)
        assert wait_dead(pid), f"replica {replica}'s worker outlived SIGKILL"
        self.killed = pid
        deadline = time.monotonic() + self._settle_s
        while backend.fleet.health.state(replica) != ReplicaState.STALE:
            assert time.monotonic() < deadline, f"replica {replica}'s replacement did not start"
            time.sleep(0.05)
        return backend.commit_weight_update()
