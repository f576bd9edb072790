"""A replica lost in the middle of a refit, and the new weights of a refit, for the healing tests
on fake and real engines."""

from __future__ import annotations

import os
import signal
import time

import torch
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


def perturbed_weights(state_dict: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """New weights for a refit: every tensor of ``state_dict`` moved by a fifth of its spread,
    the same for the same ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t + 0.2 * t.float().std() * torch.randn(t.shape, generator=generator)
        for name, t in state_dict.items()
    }


class KillDuringLoad:
    """``fleet``'s next replacement that loads a peer's copy of the committed weights has its
    worker SIGKILLed in that load: its weight update open (``start_weight_update`` answered),
    no bucket loaded yet. Later loads run untouched.

    Attributes:
        killed: the pid of the worker it killed (None until then).
    """

    def __init__(self, fleet):
        self.killed: int | None = None
        load = fleet._load

        def killing_load(actor, handles, version):
            if self.killed is not None:
                return load(actor, handles, version)
            return load(_KilledAfterStart(actor, self), handles, version)

        fleet._load = killing_load


class _KilledAfterStart:
    """An actor handle whose ``load_weights`` first SIGKILLs the actor's process."""

    def __init__(self, actor, killer: KillDuringLoad):
        self._actor = actor
        self._killer = killer

    def __getattr__(self, name: str):
        if name == "load_weights":
            import ray

            pid = ray.get(self._actor.info.remote(), timeout=60)["pid"]
            os.kill(pid, signal.SIGKILL)
            assert wait_dead(pid), "a replacement's worker outlived SIGKILL"
            self._killer.killed = pid
        return getattr(self._actor, name)
