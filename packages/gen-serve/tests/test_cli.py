"""The ``gen-serve`` command: it starts from the command line on 127.0.0.1, answers requests, and
on SIGTERM ends the requests in flight within its grace period, stops its engines and exits 0,
leaving no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from gen_testkit.servers import ServerProcess, free_port

GRACE_S = 3


def _command(backend: str, model: Any, port: int) -> list[str]:
    script = Path(sys.executable).parent / "gen-serve"
    assert script.is_file(), f"the gen-serve console script is not installed at {script}"
    return [
        str(script),
        "--backend",
        backend,
        "--model",
        str(model.path),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--served-model-name",
        "tiny",
        "--graceful-seconds",
        str(GRACE_S),
        "--log-level",
        "warning",
    ]


def _session_processes(sid: int) -> list[int]:
    """Processes still in session ``sid`` (the server's, started as its own session)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    alive.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return alive


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_sigterm_ends_requests_in_flight_stops_engines_and_leaves_nothing(tiny_qwen2, backend):
    if backend == "vllm":
        pytest.importorskip("vllm")
    port = free_port()
    server = ServerProcess(
        _command(backend, tiny_qwen2, port),
        port,
        env={"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"},
        name=f"gen-serve-{backend}",
    )
    try:
        server.wait_ready(300)
        reply = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4

        # A long streaming request is running when SIGTERM comes.
        streamed: list[str] = []
        ended = threading.Event()

        def long_request() -> None:
            body = {
                "model": "tiny",
                "prompt": [5, 17, 42],
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
            }
            try:
                with httpx.stream(
                    "POST", f"{server.url}/v1/completions", json=body, timeout=60
                ) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            streamed.append(line[6:])
            except httpx.HTTPError:
                pass  # the connection closed under it: cancelled, which is allowed
            ended.set()

        client = threading.Thread(target=long_request, daemon=True)
        client.start()
        deadline = time.monotonic() + 60
        while not streamed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert streamed, "the long request never started streaming"
        sid = os.getsid(server.process.pid)
        stopped = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(GRACE_S + 60)
        took = time.monotonic() - stopped
        assert code == 0, f"gen-serve exited with {code}:\n{server.tail()}"
        assert took < GRACE_S + 45, f"gen-serve took {took:.0f} s to stop"
        assert ended.wait(10), "the client of the request in flight was left hanging"
        finals = [json.loads(x) for x in streamed if x.startswith("{")]
        assert finals, "the request in flight got no chunk"
        deadline = time.monotonic() + 20
        while _session_processes(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _session_processes(sid), "processes of the server outlived it"
    finally:
        server.stop()


def _signal_every_process(sid: int) -> None:
    """SIGTERM to every process of the session, whatever its group: what a service manager's
    ``KillMode=control-group`` does."""
    for pid in _session_processes(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


@pytest.mark.parametrize("reached", ["the_process_group", "every_process"])
def test_sigterm_to_the_whole_vllm_service_stops_it_cleanly_and_fast(tiny_qwen2, reached):
    """``kill -TERM -PGID`` once reached Ray's own daemons, which share the server's process
    group: the server's shutdown then waited 60 s for Ray's GCS and exited 1. Ray's daemons
    now run in groups of their own, and when a signal reaches them anyway (every process of
    the service signalled) nothing is asked of the dead GCS: either way the server exits 0 in
    seconds and leaves no process behind."""
    pytest.importorskip("vllm")
    port = free_port()
    server = ServerProcess(
        _command("vllm", tiny_qwen2, port),
        port,
        env={"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"},
        name=f"gen-serve-vllm-{reached}",
    )
    try:
        server.wait_ready(300)
        sid = os.getsid(server.process.pid)
        assert len(_session_processes(sid)) > 2, "Ray's processes are not in the session"
        stopped = time.monotonic()
        if reached == "the_process_group":
            os.killpg(server.process.pid, signal.SIGTERM)
        else:
            _signal_every_process(sid)
        code = server.process.wait(120)
        took = time.monotonic() - stopped
        assert code == 0, f"gen-serve exited with {code}:\n{server.tail()}"
        assert took < 40, f"gen-serve took {took:.0f} s to stop:\n{server.tail()}"
        deadline = time.monotonic() + 20
        while _session_processes(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _session_processes(sid), "processes of the server outlived it"
    finally:
        server.stop()
