"""Where a worker's output goes (``gen_vllm.logs``): vLLM's lines, C++ notices and library
warnings to the log file; this package's own warnings to the original standard error, which
Ray forwards to the driver; everything to the terminal with ``GEN_VERBOSE=1``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_WORKER = """
import logging, os, warnings
from gen_vllm.logs import redirect_worker_output
redirect_worker_output()
print("vLLM: Initializing a V1 LLM engine", flush=True)
os.write(2, b"Warning: NUMA binding: Using MEMBIND policy\\n")
warnings.warn("reduce_op is deprecated", FutureWarning)
logging.getLogger("gen_vllm.worker").warning("the vLLM engine failed to start")
"""


def _run_worker(tmp_path: Path, **env: str) -> tuple[str, str, str]:
    log = tmp_path / "engines.log"
    clean = {k: v for k, v in os.environ.items() if k not in ("GEN_VERBOSE", "GEN_LOG_FILE")}
    done = subprocess.run(
        [sys.executable, "-c", _WORKER],
        env={**clean, "GEN_LOG_FILE": str(log), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout, done.stderr, log.read_text() if log.exists() else ""


def test_a_quiet_worker_keeps_the_engine_in_the_file_and_its_own_warnings_out(tmp_path: Path):
    out, err, log = _run_worker(tmp_path)
    for line in ("Initializing a V1 LLM engine", "NUMA binding", "reduce_op is deprecated"):
        assert line in log, f"{line!r} not in the log file:\n{log}"
        assert line not in out + err, f"{line!r} reached the terminal:\n{out}{err}"
    assert out == ""
    assert err.strip() == "WARNING gen_vllm.worker: the vLLM engine failed to start"


def test_a_verbose_worker_redirects_nothing(tmp_path: Path):
    out, err, log = _run_worker(tmp_path, GEN_VERBOSE="1")
    assert "Initializing a V1 LLM engine" in out
    assert "NUMA binding" in err and "reduce_op is deprecated" in err
    assert log == ""


def test_the_log_file_is_picked_once_per_process_and_said_where(tmp_path: Path):
    script = (
        "from gen_vllm.logs import log_file, worker_env\n"
        "print(log_file()); print(log_file()); print(worker_env())\n"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("GEN_VERBOSE", "GEN_LOG_FILE")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**clean, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    first, second, env = done.stdout.splitlines()
    assert first == second and first.startswith(str(tmp_path / "gen-logs"))
    assert env == repr({"GEN_LOG_FILE": first})
    assert done.stderr.count(first) == 1 and "GEN_VERBOSE=1" in done.stderr
