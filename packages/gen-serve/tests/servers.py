"""Test servers: a gen-serve app on 127.0.0.1, on a free port, on a thread of this process; and
the session's servers over gen-hf and gen-vllm (``served_models``), which the tests of every
package that drives them (gen-serve's, gen-remote's) share."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from gen_testkit.servers import free_port

__all__ = [
    "ServedModels",
    "ServerThread",
    "free_port",
    "hf_backend",
    "serve",
    "served_models",
    "tokenizer_of",
]


class ServerThread:
    """A gen-serve app served by uvicorn on a thread; ``url`` once it listens."""

    def __init__(self, app: Any):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, name="gen-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    @property
    def state(self) -> Any:
        return self.app.state.server

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def tokenizer_of(model: Any) -> Any:
    from gen_serve import TextCodec

    codec = TextCodec.from_model_dir(model.path)

    class Tokens:
        pad_token_id = codec.pad_token_id
        eos_token_id = codec.eos_token_id

    return codec, Tokens()


def serve(backend: Any, model: Any, **settings: Any) -> ServerThread:
    from gen_serve import ServerSettings, build_app, sampling_defaults

    codec, _ = tokenizer_of(model)
    app = build_app(
        backend,
        ServerSettings(
            model_name="tiny",
            model_path=str(model.path),
            defaults=sampling_defaults(str(model.path)),
            **settings,
        ),
        codec=codec,
    )
    return ServerThread(app)


def hf_backend(model: Any, **extra: Any) -> Any:
    from gen_hf import HfGeneration
    from gen_interface import configure_generation_config

    _, tokens = tokenizer_of(model)
    config = configure_generation_config(
        {
            "backend": "hf",
            "model_name": str(model.path),
            "dtype": "float32",
            "hf_cfg": {"device": "cpu"},
            **extra,
        },
        tokens,
    )
    return HfGeneration(config)


class ServedModels:
    """Servers by (backend, model, logprobs mode), started on first use: gen-serve over gen-hf,
    or over a gen-vllm CPU engine (one replica). Tests that change a server's weights put the
    model's own weights back before they end, so a server serves the same model to every
    test; its weight version only grows."""

    def __init__(self) -> None:
        self._servers: dict[tuple[str, str, str], tuple[ServerThread, Callable[[], None]]] = {}

    def get(self, backend: str, model: Any, logprobs_mode: str = "raw") -> ServerThread:
        key = (backend, str(model.path), logprobs_mode)
        if key not in self._servers:
            start = _hf_server if backend == "hf" else _vllm_server
            self._servers[key] = start(model, logprobs_mode)
        return self._servers[key][0]

    def close(self) -> None:
        """Stop every server started so far (a later ``get`` starts it again)."""
        for server, release in self._servers.values():
            server.stop()
            release()
        self._servers.clear()


_SESSION = ServedModels()


def served_models() -> ServedModels:
    """This process's ``ServedModels``: one for the test session, so that a vLLM engine (about
    30 s to start here) serves gen-serve's tests and gen-remote's alike. Each package's
    session fixture closes it at the session's end, when no test is left to use it."""
    return _SESSION


def _hf_server(model: Any, logprobs_mode: str) -> tuple[ServerThread, Callable[[], None]]:
    return serve(hf_backend(model, logprobs_mode=logprobs_mode), model), lambda: None


def _vllm_server(model: Any, logprobs_mode: str) -> tuple[ServerThread, Callable[[], None]]:
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
