"""Whether a test's worker process still runs (the tests kill and stop them)."""

from __future__ import annotations

import contextlib
import os
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
