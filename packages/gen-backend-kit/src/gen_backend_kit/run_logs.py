"""Where the engines' own output goes in a run: one policy for every backend and command.

Two environment variables steer it. ``GEN_VERBOSE=1`` (or true, yes, on): engine, server and
Ray output reaches the terminal. Otherwise it is appended to the file ``GEN_LOG_FILE`` names;
with none named, the first backend or command that needs one picks
``<temp dir>/gen-logs/[<name>-]<time>-<pid>.log`` and exports it as ``GEN_LOG_FILE``, so every
backend, worker and server of one run shares the file.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["LOG_FILE_ENV", "VERBOSE_ENV", "log_file", "verbose"]

#: Set to 1 (or true, yes, on): engine, server and Ray output reach the terminal.
VERBOSE_ENV = "GEN_VERBOSE"
#: The file engine, server and Ray output is appended to when not verbose.
LOG_FILE_ENV = "GEN_LOG_FILE"


def verbose() -> bool:
    """Whether ``GEN_VERBOSE`` asks for engine output on the terminal."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def log_file(announce: str | None = None, name: str = "") -> Path:
    """``GEN_LOG_FILE``, or a file picked now for this run (its directory made, the path
    exported as ``GEN_LOG_FILE``).

    Args:
        announce: what the file holds, e.g. ``"gen-vllm: vLLM's and Ray's logs"``; when a file
            is picked here, standard error says so once (None: the caller says where).
        name: a prefix for a picked file's name (a command's name).
    """
    named = os.environ.get(LOG_FILE_ENV)
    if named:
        return Path(named)
    directory = Path(tempfile.gettempdir()) / "gen-logs"
    directory.mkdir(parents=True, exist_ok=True)
    prefix = f"{name}-" if name else ""
    path = directory / f"{prefix}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    os.environ[LOG_FILE_ENV] = str(path)
    if announce is not None:
        print(
            f"{announce} go to {path} ({VERBOSE_ENV}=1 shows them here)",
            file=sys.stderr,
            flush=True,
        )
    return path
