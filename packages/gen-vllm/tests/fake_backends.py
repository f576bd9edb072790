"""Building backends on the fake engine (``fake_vllm_engine.py``) for tests, and closing them."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_vllm_engine import FakeEngineFactory, read_events
from gen_testkit.conformance import conformance_config

__all__ = ["FakeBackends", "pid_of"]


def pid_of(backend) -> int:
    """The process of ``backend``'s first engine."""
    return backend.replicas.infos[0]["pid"]


class FakeBackends:
    """Builds GPU clusters (logical GPUs) and fake-engine backends logging to ``log_dir``, and
    shuts them all down on ``close``."""

    def __init__(self, ray_session, log_dir: Path):
        self.gpus = int(ray_session.cluster_resources().get("GPU", 0))
        self.log_dir = log_dir
        self._made: list = []

    def cluster(self, bundles, **kwargs):
        from gen_vllm import RayVirtualCluster

        if sum(bundles) > self.gpus:
            pytest.skip(f"needs {sum(bundles)} (logical) GPUs in Ray, it has {self.gpus}")
        cluster = RayVirtualCluster(bundles, use_gpus=True, num_cpus_per_bundle=1, **kwargs)
        self._made.append(cluster)
        return cluster

    def backend(
        self,
        cluster,
        model,
        *,
        colocated=False,
        name_prefix="fake",
        faults=None,
        extra=None,
        **cfg,
    ):
        """A fake-engine backend; ``cfg`` is its ``vllm_cfg``, ``extra`` other config keys."""
        from gen_vllm import VllmGeneration

        config = conformance_config(
            backend="vllm",
            model_name=str(model if isinstance(model, (str, Path)) else model.path),
            vocab_size=512,
            colocated={"enabled": colocated},
            vllm_cfg=cfg,
            **(extra or {}),
        )
        backend = VllmGeneration(
            cluster,
            config,
            name_prefix,
            engine_factory=FakeEngineFactory(self.log_dir, **(faults or {})),
        )
        self._made.insert(0, backend)  # backends close before their clusters
        return backend

    def events(self, backend, since: int = 0):
        """``(event, level, tags)`` of the sleep, wake-up and update events of ``backend``'s first
        engine, from its ``since``-th event on."""
        mine = [e for e in read_events(self.log_dir) if e["pid"] == pid_of(backend)]
        return [
            (e["event"], e.get("level"), e.get("tags"))
            for e in mine[since:]
            if e["event"] in ("sleep", "wake_up", "update")
        ]

    def event_count(self, backend) -> int:
        return sum(e["pid"] == pid_of(backend) for e in read_events(self.log_dir))

    def close(self):
        for made in self._made:
            made.shutdown()
        self._made.clear()
