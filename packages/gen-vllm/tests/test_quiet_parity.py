"""``gen-parity`` over a vLLM engine shows the project's own lines and the table only: vLLM's
start-up, Ray's messages and the workers' warnings go to the log file it names first; with
``--json FILE`` its pictures land beside it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

#: What gen-parity itself prints: progress lines, the table, its closing notes.
_OWN = re.compile(r"^(\[\s*\d+\.\ds\] .*|\|.*\||sampling: chi-square .*|)$")


def test_gen_parity_prints_its_own_lines_and_logs_the_engines(tmp_path: Path):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GEN_VERBOSE", "GEN_LOG"))}
    done = subprocess.run(
        [
            *(sys.executable, "-m", "gen_testkit.parity.cli", "--backends", "vllm"),
            *("--samples", "60", "--json", str(tmp_path / "parity.json")),
        ],
        env={**clean, "GEN_LOG_FILE": str(tmp_path / "engines.log")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed
    foreign = [line for line in printed.splitlines() if not _OWN.match(line)]
    assert not foreign, "lines that are not gen-parity's own:\n" + "\n".join(foreign)
    first = done.stdout.splitlines()[0]
    assert f"engine and Ray logs: {tmp_path / 'engines.log'}" in first
    logged = (tmp_path / "engines.log").read_text()
    assert "Initializing a V1 LLM engine" in logged, logged[-2000:]
    assert "Started a local Ray instance" in logged, logged[-2000:]
    page = tmp_path / "parity-plots" / "index.html"
    assert f"wrote {page}" in done.stdout
    assert len(list(page.parent.glob("*.png"))) == 4
