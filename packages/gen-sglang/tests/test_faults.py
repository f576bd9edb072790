"""A server that dies mid-generate with healing off: a typed error within seconds, and no process or
shared-memory file left behind; an owner that dies without a word leaves none either (a normal
shutdown is checked by ``test_rl_loop``)."""

from __future__ import annotations

import contextlib
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
    """Fail-stop (``healing: false``): the loss breaks the backend. Healing is checked by
    ``test_healing``."""
    config = conformance_config(
        backend="sglang",
        model_name=str(tiny_qwen2.path),
        vocab_size=tiny_qwen2.vocab_size,
        max_new_tokens=400,
        stop_token_ids=[],
        sglang_cfg={"healing": False},
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


#: A stand-in ``sglang.launch_server`` that leaves what SGLang leaves in ``/dev/shm``: a
#: multiprocessing semaphore registered with Python's resource tracker (spawn start method,
#: as SGLang's, so it is not unlinked at once), and a slot file a child holds open. It writes
#: their names to ``$STANDIN_NAMES``, then waits.
_STANDIN = """
import multiprocessing, os, sys, time

def hold(path):
    handle = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    time.sleep(600)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    lock = ctx.Lock()
    slot = f"/dev/shm/sglang_loads_standin_{os.getpid()}.shm"
    child = ctx.Process(target=hold, args=(slot,))
    child.start()
    while not os.path.exists(slot):
        time.sleep(0.05)
    with open(os.environ["STANDIN_NAMES"], "w") as names:
        names.write(f"/dev/shm/sem.{lock._semlock.name.lstrip('/')} {slot}")
    time.sleep(600)
"""


def _standin(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The environment that makes this package's launcher run ``_STANDIN``, and the file it
    writes its names to."""
    fake = tmp_path / "sglang"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(_STANDIN)
    names = tmp_path / "names"
    path = ":".join([str(tmp_path), *support_dir(cpu=False)])
    return {"PYTHONPATH": path, "STANDIN_NAMES": str(names)}, names


def _wait_for(path: Path, timeout_s: float = 60.0) -> list[Path]:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [Path(name) for name in path.read_text().split()]


@pytest.mark.parametrize("how", ["stopped", "died_on_its_own"])
def test_a_server_leaves_no_semaphore_or_slot_file_in_dev_shm(tmp_path: Path, how: str):
    """A SIGKILL to the whole session killed Python's resource tracker with it, so every start
    left a ``sem.mp-*`` semaphore; the slot file was found only in processes still running,
    so a server that had died left it. Now the tracker is killed last and unlinks the
    semaphore, the semaphores are named after the server (so those of a session that died
    whole are found), and the files seen while the server started are removed at stop."""
    from gen_interface import BackendUnavailableError
    from gen_sglang.server import SglangServer

    env, names_file = _standin(tmp_path)
    server = SglangServer(sys.executable, "model", [], env, name="standin")
    try:
        semaphore, slot = _wait_for(names_file)
        assert semaphore.exists() and slot.exists()
        with pytest.raises(BackendUnavailableError, match="did not answer"):
            server.wait_ready(2.0)  # the stand-in serves nothing; the server is watched
        if how == "died_on_its_own":
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()
            assert slot.exists(), "nothing is left to clean: the check tests nothing"
    finally:
        server.stop()
    assert session_processes(server.process.pid) == []
    assert not slot.exists(), "the slot file outlived the server"
    assert not semaphore.exists(), "the semaphore outlived the server"
    assert semaphore.name.startswith(f"sem.mp-gen-sglang-{server.process.pid}-")


def test_a_server_whose_owner_is_killed_leaves_no_semaphore(tmp_path: Path):
    """The owner SIGKILLed: the server's own watch kills its session, the resource tracker
    last, so the semaphore its processes registered is unlinked too."""
    env, names_file = _standin(tmp_path)
    script = (
        "import sys, time\n"
        "from gen_sglang.server import SglangServer\n"
        f"server = SglangServer(sys.executable, 'model', [], {env!r}, name='t')\n"
        "made = server.process.pid\n"
    )
    owner, line = _owner(script)
    pgid = int(line)
    semaphore, slot = _wait_for(names_file)
    assert semaphore.exists() and slot.exists()
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 15
    while (session_processes(pgid) or semaphore.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert session_processes(pgid) == [], "the server outlived its owner"
    assert not slot.exists(), "the slot file outlived the server"
    assert not semaphore.exists(), "the semaphore outlived the server"


def _sglang_files() -> set[str]:
    """What SGLang's servers leave in ``/dev/shm``: semaphores and load slot files."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(("sem.mp-", "sglang_loads_"))}


def _held_by_session(pgid: int) -> set[str]:
    """Names of the ``/dev/shm`` files the processes of session ``pgid`` have mapped."""
    held = set()
    for pid in session_processes(pgid):
        with contextlib.suppress(OSError):
            maps = Path(f"/proc/{pid}/maps").read_text()
            lines = [line for line in maps.splitlines() if "/dev/shm/" in line]
            held |= {line.split("/dev/shm/")[1] for line in lines}
    return held


def test_repeated_starts_of_real_servers_leave_nothing_in_dev_shm(tiny_qwen2: TinyModel):
    """Each start and stop of a real SGLang server left one ``sem.mp-*`` semaphore in
    ``/dev/shm`` (18 of them after a day of test runs here). Over repeated starts, every such
    file a server made is gone once it stops: its semaphores (named after it) and its slot
    file (mapped by its scheduler). Files other SGLang servers on this machine make meanwhile
    are told apart by those marks, not counted."""
    config = conformance_config(
        backend="sglang", model_name=str(tiny_qwen2.path), vocab_size=tiny_qwen2.vocab_size
    )
    data = BatchedDataDict(
        {"input_ids": torch.tensor([[5, 6, 7, 8]]), "input_lengths": torch.tensor([4])}
    )
    for start in range(2):
        before = _sglang_files()
        backend = SglangGeneration(config)
        try:
            pgid = backend._servers[0].process.pid
            assert backend.generate(data)["generation_lengths"][0] > 0
            made = _sglang_files() - before
            ours = {
                name
                for name in made
                if name.startswith(f"sem.mp-gen-sglang-{pgid}-") or name in _held_by_session(pgid)
            }
        finally:
            backend.shutdown()
        kinds = {name[:7] for name in ours}
        assert kinds == {"sem.mp-", "sglang_"}, f"start {start} made {sorted(made)}: tests nothing"
        left = ours & _sglang_files()
        assert not left, f"start {start} left {sorted(left)} in /dev/shm"
