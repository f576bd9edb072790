"""``SglangServer``: one ``sglang.launch_server`` process on 127.0.0.1, started, watched, stopped.

The server runs in a session of its own, so stopping it stops its scheduler and detokenizer
processes too; a finaliser stops it if its owner forgets (or exits), and the server ends itself
when its owner dies without a word (``server_side/gen_sglang_launch.py`` watches its parent),
so no server outlives the backend that started it. Its output goes to a log file whose tail
every start-up error quotes; when it stops, that log is appended to the run's log file, or with
``GEN_VERBOSE=1`` its lines reach standard error as they come (``logs.py``).

SGLang leaves files behind however it stops (its ZMQ sockets in the temp directory, a
``sglang_loads_*`` slot file in ``/dev/shm`` per server, multiprocessing's ``sem.mp-*``
semaphores). So each server gets a directory of its own in shared memory as its ``TMPDIR``,
named with the owner's tag like the staged checkpoints (``checkpoint.STAGED_PREFIX``, swept the
same way when the owner is gone), and ``stop`` removes it, and the ``/dev/shm`` files the
server's processes had open at any check while it started or when it stopped (so a server that
died on its own leaves none either). Stopping is SIGKILL to the session, as SGLang stops its own
processes (a SIGTERM only adds its 5 s crash-diagnostics pause), with Python's resource tracker
killed last, so that it unlinks the semaphores (``kill_session``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
from gen_interface import BackendUnavailableError
from gen_interface.weights.shm import owner_tag, segment_dir, sweep_orphans

from gen_sglang.checkpoint import STAGED_PREFIX
from gen_sglang.logs import Echo, keep_log, verbose
from gen_sglang.server_side.gen_sglang_launch import (
    kill_session,
    semaphore_files,
    session_processes,
    shared_memory_files,
)

__all__ = ["SglangServer", "free_port", "session_processes", "shared_memory_files"]

_LOG_TAIL = 3000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class SglangServer:
    """One SGLang HTTP server process.

    Args:
        python: the interpreter of SGLang's environment.
        model: ``--model-path``.
        args: further ``launch_server`` arguments.
        env: variables added to this process's environment for the server.
        name: how errors name it ("replica 0").
    """

    def __init__(
        self,
        python: str | Path,
        model: str,
        args: Sequence[str],
        env: Mapping[str, str],
        *,
        name: str,
    ):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        owned = f"{STAGED_PREFIX}{owner_tag()}-"
        sweep_orphans(Path(tempfile.gettempdir()), STAGED_PREFIX)  # logs of owners gone
        self.tmp_dir = Path(tempfile.mkdtemp(prefix=owned, dir=segment_dir()))
        handle, log = tempfile.mkstemp(prefix=owned, suffix=".log")
        self.log_path = Path(log)
        command = [str(python), "-m", "gen_sglang_launch", "--model-path", model]
        command += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        try:
            self.process = subprocess.Popen(
                command,
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env, "TMPDIR": str(self.tmp_dir)},
                start_new_session=True,
            )
        except OSError as exc:
            os.close(handle)
            _remove_files(self.log_path, self.tmp_dir)
            raise BackendUnavailableError(
                f"could not start SGLang ({name}) with {python}: {exc}; set sglang_cfg.python "
                "to an environment with sglang, or leave it out for the managed one"
            ) from exc
        os.close(handle)
        echo = Echo(name, self.log_path) if verbose() else None
        #: ``/dev/shm`` files the server's processes were seen holding: its own, removed at stop.
        self.shm_files: set[Path] = set()
        self._finalizer = weakref.finalize(
            self, _stop, self.process, self.log_path, self.tmp_dir, name, echo, self.shm_files
        )

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the server answers ``/health_generate`` (it has generated a token).

        Raises:
            BackendUnavailableError: it exited, or did not answer within ``timeout_s``; the
                message quotes its log.
        """
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, timeout=30.0) as client:
            while time.monotonic() < deadline:
                self.shm_files |= shared_memory_files(self.process.pid)
                if self.process.poll() is not None:
                    raise BackendUnavailableError(
                        f"SGLang ({self.name}) exited with code {self.process.returncode} while "
                        f"starting:\n{self.log_tail()}"
                    )
                try:
                    if client.get("/health_generate").status_code == 200:
                        self.shm_files |= shared_memory_files(self.process.pid)
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        raise BackendUnavailableError(
            f"SGLang ({self.name}) did not answer within {timeout_s:g} s "
            f"(sglang_cfg.start_timeout_s):\n{self.log_tail()}"
        )

    def died(self) -> str | None:
        """Why the server is gone (its exit code and log), or None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        return f"the SGLang server ({self.name}, pid {self.process.pid}) exited with code {code}"

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-_LOG_TAIL:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Stop the server and every process it started; idempotent."""
        self._finalizer()


def _stop(
    process: subprocess.Popen[bytes],
    log_path: Path,
    tmp_dir: Path,
    name: str = "server",
    echo: Echo | None = None,
    seen: set[Path] | None = None,
) -> None:
    """Kill the server's session (``kill_session``: 5 s at most for the resource tracker to
    unlink its semaphores), keep its log in the run's (or finish echoing it), remove its files:
    its ``TMPDIR``, the ``/dev/shm`` files its processes held now or were ``seen`` holding, and
    the semaphores named after it that are left (its tracker died first)."""
    slots = shared_memory_files(process.pid) | (seen or set())
    process.poll()
    kill_session(process.pid)
    process.poll()
    for slot in [*slots, *semaphore_files(process.pid)]:
        slot.unlink(missing_ok=True)
    if echo is not None:
        echo.stop()
    else:
        keep_log(name, log_path)
    _remove_files(log_path, tmp_dir)


def _remove_files(log_path: Path, tmp_dir: Path) -> None:
    log_path.unlink(missing_ok=True)
    shutil.rmtree(tmp_dir, ignore_errors=True)
