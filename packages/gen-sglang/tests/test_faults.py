"""A server that dies mid-generate: a typed error within seconds, and no process or
shared-memory file left behind; an owner that dies without a word leaves none either (a normal
shutdown is checked by ``test_rl_loop``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from gen_interface import BackendBrokenError, BatchedDataDict, GenerationError
from gen_sglang import SglangGeneration
from gen_sglang.checkpoint import StagedCheckpoint
from gen_sglang.environment import support_dir
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
    staged, tmp_dir = backend._staged.root, server.tmp_dir
    assert session_processes(pgid), "the server runs in a session of its own"
    assert staged.exists() and tmp_dir.exists()
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
    assert not staged.exists() and not tmp_dir.exists()


def _owner(script: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """A process that runs ``script`` (which prints one line, then waits), and that line."""
    owner = subprocess.Popen(
        [sys.executable, "-c", script + "print(made, flush=True)\ntime.sleep(600)\n"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert owner.stdout is not None
    return owner, owner.stdout.readline().strip()


def test_a_server_whose_owner_is_killed_without_a_word_ends_itself(tmp_path: Path):
    """SIGKILL the process that started a server (no finaliser runs): the server, every
    process in its session and its temp directory are gone within seconds. The server here is
    this package's launcher running a stand-in ``sglang.launch_server`` that starts a child and
    waits."""
    fake = tmp_path / "sglang"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(
        "import subprocess, time\nsubprocess.Popen(['sleep', '600'])\ntime.sleep(600)\n"
    )
    path = ":".join([str(tmp_path), *support_dir(cpu=False)])
    script = (
        "import sys, time\n"
        "from gen_sglang.server import SglangServer\n"
        f"env = {{'PYTHONPATH': {path!r}}}\n"
        "server = SglangServer(sys.executable, 'model', [], env, name='t')\n"
        "time.sleep(2)\n"  # the stand-in has started its child
        "made = f'{server.process.pid} {server.tmp_dir}'\n"
    )
    owner, line = _owner(script)
    pgid_text, tmp_dir = line.split()
    pgid = int(pgid_text)
    assert Path(tmp_dir).is_dir()
    assert len(session_processes(pgid)) >= 2
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 10
    while session_processes(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert session_processes(pgid) == [], "the server outlived its owner"
    assert not Path(tmp_dir).exists(), "the server left its temp directory"


def test_a_staged_checkpoint_whose_owner_is_killed_is_swept_by_the_next(tiny_qwen2: TinyModel):
    """SIGKILL the owner of a staged checkpoint: its directory in shared memory stays until the
    next staged checkpoint is made on the machine (a backend starting), which removes it."""
    script = (
        "import time\n"
        "from gen_sglang.checkpoint import StagedCheckpoint\n"
        f"staged = StagedCheckpoint(__import__('pathlib').Path({str(tiny_qwen2.path)!r}), {{}}, "
        "frozenset())\n"
        "made = staged.root\n"
    )
    owner, line = _owner(script)
    owner.kill()
    owner.wait()
    staged = Path(line)
    assert staged.is_dir(), "nothing ran on SIGKILL, so the directory is still there"
    StagedCheckpoint(tiny_qwen2.path, {}, frozenset()).close()
    assert not staged.exists(), "the dead owner's staged checkpoint was not swept"
