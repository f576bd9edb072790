"""Test servers for the remote backend: gen-serve on 127.0.0.1 (a free port, a thread of this
process) over gen-hf or over a gen-vllm CPU engine, and the client config that reaches one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from gen_testkit.models import TinyModel
from servers import ServerThread, hf_backend, serve, tokenizer_of

__all__ = ["ServedModels", "remote_config"]


class ServedModels:
    """Servers by (backend, model, logprobs mode), started on first use."""

    def __init__(self) -> None:
        self._servers: dict[tuple[str, str, str], tuple[ServerThread, Callable[[], None]]] = {}

    def get(self, backend: str, model: TinyModel, logprobs_mode: str = "raw") -> ServerThread:
        key = (backend, str(model.path), logprobs_mode)
        if key not in self._servers:
            start = _hf_server if backend == "hf" else _vllm_server
            self._servers[key] = start(model, logprobs_mode)
        return self._servers[key][0]

    def close(self) -> None:
        for server, release in self._servers.values():
            server.stop()
            release()
        self._servers.clear()


def _hf_server(model: TinyModel, logprobs_mode: str) -> tuple[ServerThread, Callable[[], None]]:
    return serve(hf_backend(model, logprobs_mode=logprobs_mode), model), lambda: None


def _vllm_server(model: TinyModel, logprobs_mode: str) -> tuple[ServerThread, Callable[[], None]]:
    pytest.importorskip("ray")
    pytest.importorskip("vllm")
    from gen_interface import configure_generation_config
    from gen_testkit.ray_for_tests import init_test_ray
    from gen_vllm import RayVirtualCluster, VllmGeneration

    init_test_ray()  # shared with other packages' tests: the same shape whoever starts it
    _, tokens = tokenizer_of(model)
    config = configure_generation_config(
        {
            "backend": "vllm",
            "model_name": str(model.path),
            "dtype": "float32",
            "logprobs_mode": logprobs_mode,
            "vllm_cfg": {"cpu_kv_cache_gib": 0.25},
        },
        tokens,
    )
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1)
    return serve(VllmGeneration(cluster, config), model), cluster.shutdown


def remote_config(server: Any, **extra: Any) -> dict[str, Any]:
    """A remote backend's config for ``server`` (anything with its ``url``)."""
    return {"backend": "remote", "remote_cfg": {"base_url": server.url}, **extra}
