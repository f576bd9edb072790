"""A server that dies, is not there, or refuses: the client raises the interface's typed errors
within seconds, and works again once a server answers on the same address."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
from gen_interface import (
    BackendUnavailableError,
    GenerationConfigError,
    GenerationError,
    GenerationInputError,
    WeightUpdateError,
    create_generation_backend,
)
from gen_testkit.models import TinyModel
from gen_testkit.servers import ServerProcess, free_port, gen_serve_command
from gen_testkit.strategies import pad_prompts
from remote_servers import ServedModels, remote_config

PROMPTS = [[5, 17, 42, 8], [99, 3]]


def _server(model: TinyModel, port: int) -> ServerProcess:
    server = ServerProcess(gen_serve_command("hf", model.path, port), port, name="gen-serve-hf")
    server.wait_ready(timeout_s=180)
    return server


def test_a_server_killed_mid_call_is_a_typed_error_and_its_successor_is_used(
    tiny_qwen2: TinyModel,
):
    port = free_port()
    server = _server(tiny_qwen2, port)
    client = create_generation_backend(
        remote_config(server, max_new_tokens=400, stop_token_ids=[], seed=3)
    )
    try:
        batch = pad_prompts(PROMPTS, "left")
        before = client.generate(batch, greedy=True)
        errors: list[BaseException] = []

        def long_call() -> None:
            try:
                client.generate(batch, greedy=True)
            except BaseException as exc:
                errors.append(exc)

        call = threading.Thread(target=long_call)
        call.start()
        time.sleep(1.0)  # the rows are running on the server
        server.process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        call.join(timeout=30)
        assert not call.is_alive(), "the call still waits on a dead server"
        assert time.monotonic() - killed < 10
        assert len(errors) == 1 and isinstance(errors[0], GenerationError), errors
        assert "broke mid-call" in str(errors[0])
        with pytest.raises(BackendUnavailableError, match="cannot reach"):
            client.generate(batch, greedy=True)
        server.stop()
        server = _server(tiny_qwen2, port)  # a new server on the same address
        again = client.generate(batch, greedy=True)
        assert again["output_ids"].equal(before["output_ids"])
        assert client.state == "ready"
    finally:
        client.shutdown()
        server.stop()


def test_no_server_at_the_address_is_backend_unavailable():
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError, match=url):
        create_generation_backend({"backend": "remote", "remote_cfg": {"base_url": url}})
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("remote_cfg", "words"),
    [
        ({}, "base_url"),
        ({"base_url": "127.0.0.1:8000"}, "http"),
        ({"base_url": "http://x", "dialect": "sglang"}, "dialect"),
        ({"base_url": "http://x", "timeout_s": 0}, "timeout_s"),
        ({"base_url": "http://x", "max_connections": 0}, "max_connections"),
    ],
)
def test_a_bad_remote_cfg_is_refused_before_any_connection(remote_cfg: dict, words: str):
    with pytest.raises(GenerationConfigError, match=words):
        create_generation_backend({"backend": "remote", "remote_cfg": remote_cfg})


def test_the_servers_errors_arrive_as_the_interfaces_types(
    served: ServedModels, tiny_qwen2: TinyModel
):
    server = served.get("hf", tiny_qwen2)
    client = create_generation_backend(remote_config(server))
    try:
        with pytest.raises(GenerationConfigError, match="logprobs_mode"):
            create_generation_backend(remote_config(server, logprobs_mode="processed"))
        # refused by the client before anything is sent, as by a local backend
        with pytest.raises(GenerationInputError, match="vocab"):
            client.generate(pad_prompts([[tiny_qwen2.vocab_size + 5]], "left"))
        # refused by the server's backend: the type crosses the wire
        with pytest.raises(WeightUpdateError, match="no_such"):
            client.prepare_refit_info({"no_such.weight": (torch.Size([3]), torch.float32)})
        with pytest.raises(WeightUpdateError, match="without a weight update in progress"):
            client.commit_weight_update()
        assert client.generate(pad_prompts(PROMPTS, "left"), greedy=True).size == 2
    finally:
        client.shutdown()


def test_shutdown_closes_the_client_only(served: ServedModels, tiny_qwen2: TinyModel):
    server = served.get("hf", tiny_qwen2)
    client = create_generation_backend(remote_config(server))
    view = client.with_sampling(temperature=0.5)
    view.shutdown()  # a front end closes only itself
    assert client.generate(pad_prompts(PROMPTS, "left")).size == 2
    client.shutdown()
    client.shutdown()  # idempotent
    with pytest.raises(GenerationError, match="shut down"):
        client.generate(pad_prompts(PROMPTS, "left"))
    assert server.client().get("/health").status_code == 200
    other = create_generation_backend(remote_config(server))
    assert other.generate(pad_prompts(PROMPTS, "left")).size == 2
    other.shutdown()
