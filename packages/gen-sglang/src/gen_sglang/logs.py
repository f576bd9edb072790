"""Where the SGLang servers' output goes: kept off the terminal by default, shown on request.

A server prints its arguments, its load and a line per batch. Each server writes to a log of
its own (whose tail every start-up error quotes, ``server.py``); beyond that:

- ``GEN_VERBOSE=1``: its lines are echoed to standard error as they come, marked with the
  server's name;
- otherwise its log is appended to the file ``GEN_LOG_FILE`` names when it stops. With no
  ``GEN_LOG_FILE`` set, the first server picks ``<temp dir>/gen-logs/<time>-<pid>.log``, sets
  ``GEN_LOG_FILE`` to it for the rest of the process (every backend of one run shares the file)
  and says where, once, on standard error.

The same two variables steer gen-vllm's engines and the project's commands.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from gen_backend_kit import run_logs
from gen_backend_kit.run_logs import LOG_FILE_ENV, VERBOSE_ENV, verbose

__all__ = ["LOG_FILE_ENV", "VERBOSE_ENV", "Echo", "keep_log", "log_file", "verbose"]


def log_file() -> Path:
    """``GEN_LOG_FILE``, or one picked now for this process (exported, announced once)."""
    return run_logs.log_file(announce="gen-sglang: SGLang's server logs")


def keep_log(name: str, server_log: Path) -> None:
    """Append a stopped server's log to the run's log file, under a header naming it (nothing
    when verbose: its lines were shown)."""
    if verbose():
        return
    try:
        text = server_log.read_text(errors="replace")
    except OSError:
        return
    target = log_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "a") as handle:
        handle.write(f"==== SGLang server ({name}), {server_log.name} ====\n{text}")
        if text and not text.endswith("\n"):
            handle.write("\n")


class Echo:
    """Echo the lines a server appends to its log to standard error, prefixed with its name,
    until ``stop``; a daemon thread polling the file."""

    def __init__(self, name: str, server_log: Path, interval_s: float = 0.2) -> None:
        self._prefix = f"({name}) "
        self._path = server_log
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"echo {name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Echo what is left, then end; idempotent."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        offset, partial = 0, ""
        while True:
            stopping = self._stopped.is_set()
            try:
                with open(self._path, errors="replace") as handle:
                    handle.seek(offset)
                    chunk = handle.read()
                    offset = handle.tell()
            except OSError:
                chunk = ""
            lines = (partial + chunk).split("\n")
            partial = lines.pop()
            for line in lines:
                print(self._prefix + line, file=sys.stderr, flush=True)
            if stopping:
                if partial:
                    print(self._prefix + partial, file=sys.stderr, flush=True)
                return
            self._stopped.wait(self._interval_s)
