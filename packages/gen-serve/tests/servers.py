"""Test servers: a gen-serve app on 127.0.0.1, on a free port, on a thread of this process."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
from gen_testkit.servers import free_port

__all__ = ["ServerThread", "free_port", "hf_backend", "serve", "tokenizer_of"]


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
