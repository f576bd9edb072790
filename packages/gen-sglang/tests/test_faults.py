"""A server that dies mid-generate: a typed error within seconds, and no process or
shared-memory file left behind (a normal shutdown is checked by ``test_rl_loop``)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from gen_interface import BackendBrokenError, BatchedDataDict, GenerationError
from gen_sglang import SglangGeneration
from gen_sglang.server import session_processes
from gen_testkit.conformance import conformance_config
from gen_testkit.models import TinyModel


def test_a_server_killed_mid_generate_is_a_typed_error_and_shutdown_leaves_nothing(
    tiny_qwen2: TinyModel,
):
    config = conformance_config(
        backend="sglang",
        model_name=str(tiny_qwen2.path),
        vocab_size=tiny_qwen2.vocab_size,
        max_new_tokens=400,
        stop_token_ids=[],
    )
    backend = SglangGeneration(config)
    server = backend._servers[0]
    pgid = server.process.pid
    staged = backend._staged.root
    assert session_processes(pgid), "the server runs in a session of its own"
    assert staged.exists()
    data = BatchedDataDict(
        {"input_ids": torch.tensor([[5, 6, 7, 8]] * 4), "input_lengths": torch.tensor([4] * 4)}
    )
    outcome: list[BaseException | None] = []

    def generate() -> None:
        try:
            backend.generate(data)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=generate)
    worker.start()
    time.sleep(1.0)  # rows are running
    killed = time.monotonic()
    os.killpg(pgid, signal.SIGKILL)
    worker.join(timeout=30)
    assert not worker.is_alive(), "generate still blocked 30 s after the server died"
    assert time.monotonic() - killed < 10
    assert len(outcome) == 1 and isinstance(outcome[0], BackendBrokenError), outcome
    assert "exited" in str(outcome[0])
    with pytest.raises(GenerationError, match="broken"):
        backend.generate(data)
    backend.shutdown()
    assert session_processes(pgid) == []
    assert not staged.exists()
