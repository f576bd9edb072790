"""The client's own rules: a light install, the life cycle on the server's routes, an API key,
a server that stops answering, and sessions that reach the server."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from gen_interface import GenerationConfigError, GenerationError, create_generation_backend
from gen_remote.wire import Wire
from gen_testkit.models import TinyModel
from gen_testkit.strategies import pad_prompts
from remote_servers import ServedModels, remote_config
from servers import hf_backend, serve

PROMPTS = [[5, 17, 42, 8], [99, 3]]


def test_importing_the_client_imports_no_serving_stack():
    code = (
        "import sys, gen_remote; "
        "print([m for m in ('ray', 'vllm', 'transformers', 'fastapi') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_finish_and_prepare_put_the_server_to_sleep_and_wake_it(
    served: ServedModels, tiny_qwen2: TinyModel
):
    server = served.get("hf", tiny_qwen2)
    client = create_generation_backend(remote_config(server))
    http = server.client()
    try:
        client.finish_generation()
        assert client.state == "finished" and http.get("/is_sleeping").json()["is_sleeping"]
        client.prepare_for_generation(tags=["weights"])
        assert client.state == "finished"  # the KV cache still sleeps
        client.prepare_for_generation()
        assert client.state == "ready" and not http.get("/is_sleeping").json()["is_sleeping"]
        assert client.generate(pad_prompts(PROMPTS, "left")).size == 2
    finally:
        client.shutdown()


def test_an_api_key_is_sent_and_a_missing_one_is_a_config_error(tiny_qwen2: TinyModel):
    server = serve(hf_backend(tiny_qwen2), tiny_qwen2, api_key="secret")
    try:
        with pytest.raises(GenerationConfigError, match="API key"):
            create_generation_backend(remote_config(server))
        config = remote_config(server)
        config["remote_cfg"]["api_key"] = "secret"
        client = create_generation_backend(config)
        assert client.generate(pad_prompts(PROMPTS, "left")).size == 2
        client.shutdown()
    finally:
        server.stop()


def test_a_server_that_stops_answering_is_an_error_after_timeout_s(
    served: ServedModels, tiny_qwen2: TinyModel
):
    real = served.get("hf", tiny_qwen2)
    config = remote_config(real, max_new_tokens=4)
    config["remote_cfg"]["timeout_s"] = 0.5
    client = create_generation_backend(config)
    silent = _SilentServer()
    try:
        client._wire.close()  # the same client, pointed at a server that never answers
        client._wire = Wire(silent.url, timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(GenerationError, match=r"sent nothing for 0.5 s"):
            client.generate(pad_prompts(PROMPTS, "left"))
        assert time.monotonic() - started < 5
        assert client.state == "ready"
    finally:
        client.shutdown()
        silent.close()


def test_a_batchs_session_ids_reach_the_server(
    served: ServedModels, tiny_qwen2: TinyModel, monkeypatch: pytest.MonkeyPatch
):
    server = served.get("hf", tiny_qwen2)
    backend = server.state.backend
    seen: list[Any] = []
    original = backend.generate_stream

    def recording(batch: Any, greedy: bool = False) -> Any:
        seen.append(batch.get("session_ids"))
        return original(batch, greedy)

    monkeypatch.setattr(backend, "generate_stream", recording)
    client = create_generation_backend(remote_config(server, max_new_tokens=2))
    try:
        batch = pad_prompts(PROMPTS, "left")
        batch["session_ids"] = ["conversation-7", None]
        client.generate(batch)
    finally:
        client.shutdown()
    assert sorted(seen, key=str) == [None, ["conversation-7"]]


class _SilentServer:
    """Accepts connections on 127.0.0.1 and never answers."""

    def __init__(self) -> None:
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen()
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return
            self._held.append(connection)

    def close(self) -> None:
        self._socket.close()
        for connection in self._held:
            connection.close()
