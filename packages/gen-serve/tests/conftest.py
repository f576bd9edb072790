"""Servers for the tests: each on 127.0.0.1, on a free port, in a thread of this process (or, for
vLLM's own server, in a process of its own), shared by every test that needs it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from servers import ServerThread, hf_backend, serve, tokenizer_of

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


@pytest.fixture(scope="session")
def hf_server(tiny_qwen2: Any) -> Iterator[ServerThread]:
    """gen-serve over gen-hf on the tiny Qwen2."""
    server = serve(hf_backend(tiny_qwen2), tiny_qwen2)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_server(tiny_qwen2: Any) -> Iterator[ServerThread]:
    """gen-serve over gen-vllm (one CPU engine) on the tiny Qwen2."""
    pytest.importorskip("ray")
    pytest.importorskip("vllm")
    from gen_interface import configure_generation_config
    from gen_testkit.ray_for_tests import init_test_ray
    from gen_vllm import RayVirtualCluster, VllmGeneration

    init_test_ray()  # shared with other packages' tests: the same shape whoever starts it
    _, tokens = tokenizer_of(tiny_qwen2)
    config = configure_generation_config(
        {
            "backend": "vllm",
            "model_name": str(tiny_qwen2.path),
            "dtype": "float32",
            "vllm_cfg": {"cpu_kv_cache_gib": 0.25},
        },
        tokens,
    )
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1)
    server = serve(VllmGeneration(cluster, config), tiny_qwen2)
    yield server
    server.stop()
    cluster.shutdown()


@pytest.fixture(params=["hf", "vllm"])
def any_server(request: pytest.FixtureRequest) -> ServerThread:
    """Each test that takes it runs on both backends."""
    return request.getfixturevalue(f"{request.param}_server")
