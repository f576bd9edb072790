"""``route_engine_logs``: what a command of this project leaves on its terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_COMMAND = """
import warnings
from gen_testkit.engine_logs import route_engine_logs
path = route_engine_logs({verbose}, "gen-parity")
print(path)
import os
print(os.environ.get("GEN_LOG_FILE"), os.environ.get("GEN_VERBOSE"))
warnings.warn("torch.distributed.reduce_op is deprecated", FutureWarning)
warnings.warn("a setting was refused", UserWarning)
"""


def _run(tmp_path: Path, verbose: bool) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GEN_", "TRANSFORMERS_"))}
    return subprocess.run(
        [sys.executable, "-c", _COMMAND.format(verbose=verbose)],
        env={**clean, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_quiet_library_warnings_go_to_the_file_and_others_still_show(tmp_path: Path):
    done = _run(tmp_path, verbose=False)
    path, exported = done.stdout.splitlines()
    assert path.startswith(str(tmp_path / "gen-logs" / "gen-parity-"))
    assert exported == f"{path} None"
    assert "reduce_op is deprecated" in Path(path).read_text()
    assert "reduce_op" not in done.stderr
    assert "a setting was refused" in done.stderr


def test_verbose_exports_gen_verbose_and_keeps_every_warning_here(tmp_path: Path):
    done = _run(tmp_path, verbose=True)
    assert done.stdout.splitlines() == ["None", "None 1"]
    assert "reduce_op is deprecated" in done.stderr and "a setting was refused" in done.stderr
    assert not (tmp_path / "gen-logs").exists()
