"""Whether a test's worker process still runs (the tests kill and stop them), and waiting for
one to end."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path


def running(pid: int) -> bool:
    """Whether process ``pid`` lives; a zombie (exited, its table entry not yet reaped) does
    not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[-1].startswith("Z"):
            return False
    return True


def wait_dead(pid: int, timeout_s: float = 30) -> bool:
    """Until process ``pid`` no longer runs; whether that happened within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(pid)
