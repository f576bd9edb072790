"""Shared vLLM engines: each costs ~30 s to start, so tests share them for the whole session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
# Engines on this small machine: a small KV cache each, so several can coexist.
KV_GIB = 0.25


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the session (``gen_testkit.ray_for_tests``: the same shape whichever
    package's tests start it), with more logical CPUs than cores so that the shared engines
    (one bundle of 1 CPU each) can all stay up at once, and logical GPUs for the fake engine.
    Real engines are built on CPU bundles (``use_gpus=False``)."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("vllm")
    from gen_testkit.ray_for_tests import init_test_ray

    started = init_test_ray()
    yield ray
    if started:
        ray.shutdown()


class EngineCache:
    """Builds ``(cluster, VllmGeneration)`` pairs on first use and keeps them for the session."""

    def __init__(self):
        self._engines: dict[tuple, tuple] = {}

    def get(
        self, model, *, replicas: int = 1, logprobs_mode: str = "raw", vllm_cfg=None, **overrides
    ):
        from gen_testkit.conformance import conformance_config
        from gen_vllm import RayVirtualCluster, VllmGeneration

        vllm_cfg = {"cpu_kv_cache_gib": KV_GIB, **(vllm_cfg or {})}
        key = (
            str(model.path),
            replicas,
            logprobs_mode,
            tuple(sorted(overrides.items())),
            tuple(sorted(vllm_cfg.items())),
        )
        if key not in self._engines:
            cluster = RayVirtualCluster([replicas], use_gpus=False, num_cpus_per_bundle=1)
            config = conformance_config(
                backend="vllm",
                model_name=str(model.path),
                vocab_size=model.vocab_size,
                logprobs_mode=logprobs_mode,
                vllm_cfg=vllm_cfg,
                **overrides,
            )
            self._engines[key] = (cluster, VllmGeneration(cluster, config))
        return self._engines[key][1]

    def close(self):
        for cluster, backend in self._engines.values():
            backend.shutdown()
            cluster.shutdown()
        self._engines.clear()


@pytest.fixture(scope="session")
def engines(ray_session):
    cache = EngineCache()
    yield cache
    cache.close()


@pytest.fixture(scope="session")
def fake_engine_shipped(ray_session):
    """Worker processes cannot import the tests directory: Ray sends the fake's code along."""
    import fake_vllm_engine

    ray_session.cloudpickle.register_pickle_by_value(fake_vllm_engine)
    yield ray_session
    ray_session.cloudpickle.unregister_pickle_by_value(fake_vllm_engine)


@pytest.fixture(scope="module")
def shared(fake_engine_shipped, tmp_path_factory):
    """Fake backends kept for the module: those no test breaks or shuts down."""
    from fake_backends import FakeBackends

    made = FakeBackends(fake_engine_shipped, tmp_path_factory.mktemp("fake_engine_events"))
    yield made
    made.close()


@pytest.fixture
def own(fake_engine_shipped, tmp_path):
    """Fake backends of one test: those it breaks, hangs or shuts down."""
    from fake_backends import FakeBackends

    made = FakeBackends(fake_engine_shipped, tmp_path)
    yield made
    made.close()
