"""Where an SGLang server's output goes (``gen_sglang.logs``): into the run's log file when the
server stops, or echoed to standard error as it comes with ``GEN_VERBOSE=1``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gen_sglang.logs import Echo, keep_log


def test_a_stopped_servers_log_is_appended_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    run_log = tmp_path / "run.log"
    run_log.write_text("vLLM's lines\n")
    monkeypatch.setenv("GEN_LOG_FILE", str(run_log))
    monkeypatch.delenv("GEN_VERBOSE", raising=False)
    server_log = tmp_path / "server.log"
    server_log.write_text("server_args=ServerArgs(...)\nThe server is fired up")
    keep_log("replica 0", server_log)
    assert run_log.read_text() == (
        "vLLM's lines\n==== SGLang server (replica 0), server.log ====\n"
        "server_args=ServerArgs(...)\nThe server is fired up\n"
    )


def test_a_verbose_run_keeps_nothing_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GEN_LOG_FILE", str(tmp_path / "run.log"))
    monkeypatch.setenv("GEN_VERBOSE", "1")
    server_log = tmp_path / "server.log"
    server_log.write_text("shown as it came\n")
    keep_log("replica 0", server_log)
    assert not (tmp_path / "run.log").exists()


def test_echo_shows_each_line_once_with_the_servers_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    server_log = tmp_path / "server.log"
    server_log.write_text("")
    echo = Echo("replica 1", server_log, interval_s=0.01)
    with open(server_log, "a") as handle:
        handle.write("Load weight begin\nLoad wei")
        handle.flush()
        time.sleep(0.2)
        handle.write("ght end\nno newline at the end")
    echo.stop()
    assert capsys.readouterr().err.splitlines() == [
        "(replica 1) Load weight begin",
        "(replica 1) Load weight end",
        "(replica 1) no newline at the end",
    ]
