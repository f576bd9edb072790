"""Where vLLM's and Ray's own output goes: a log file by default, the terminal on request.

An engine prints a few dozen lines as it starts (its config, deprecation warnings from inside
vLLM and torch, NUMA and allocator notices) and a throughput line every few seconds; Ray adds
its own start-up messages. None of it is this project's, and all of it would sit between a
command's own progress lines. So by default:

- each worker sends its process's standard output and error (vLLM's logs, C++ notices, Python
  warnings) to the log file ``GEN_LOG_FILE`` names, appending; records of this package's own
  loggers at WARNING and above still reach the worker's original standard error, which Ray
  forwards to the driver, so a warning that matters and every error still show;
- a Ray that ``RayVirtualCluster`` starts logs its driver-side messages to that file too.

``GEN_VERBOSE=1`` sends everything to the terminal as before. With neither variable set, the
first backend that needs a log file picks ``<temp dir>/gen-logs/<time>-<pid>.log``, sets
``GEN_LOG_FILE`` to it for the rest of the process (so every backend and worker of one run
shares the file) and says where, once, on standard error. A caller that sets ``GEN_LOG_FILE``
itself says where (``gen-parity`` prints it with its progress).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from gen_backend_kit import run_logs
from gen_backend_kit.run_logs import LOG_FILE_ENV, VERBOSE_ENV, verbose

__all__ = [
    "LOG_FILE_ENV",
    "VERBOSE_ENV",
    "log_file",
    "quiet_ray_driver",
    "redirect_worker_output",
    "verbose",
    "worker_env",
]


def log_file() -> Path:
    """The file engine output goes to: ``GEN_LOG_FILE``, or one picked now for this process
    (exported as ``GEN_LOG_FILE`` and announced once on standard error)."""
    return run_logs.log_file(announce="gen-vllm: vLLM's and Ray's logs")


def worker_env() -> dict[str, str]:
    """What a worker needs to know to send its output where this process's goes."""
    if verbose():
        return {VERBOSE_ENV: "1"}
    return {LOG_FILE_ENV: str(log_file())}


def quiet_ray_driver() -> int:
    """Unless verbose: Ray's driver-side messages go to the log file, and only its errors to
    the terminal. Call after importing ray, before ``ray.init``; returns the level to start
    Ray's driver logger at (``ray.init``'s ``logging_level``)."""
    if verbose():
        return logging.INFO
    ray_logger = logging.getLogger("ray")
    target = str(log_file())
    for handler in ray_logger.handlers:  # Ray's own, to the terminal
        if getattr(handler, "baseFilename", None) != target:
            handler.setLevel(logging.ERROR)
    if not any(getattr(h, "baseFilename", None) == target for h in ray_logger.handlers):
        ray_logger.addHandler(logging.FileHandler(target))
    return logging.INFO


def redirect_worker_output() -> None:
    """In a worker, before vLLM is imported: unless verbose, append this process's standard
    output and error to the log file, keeping this package's own warnings and errors on the
    original standard error (which Ray forwards to the driver)."""
    if verbose() or not os.environ.get(LOG_FILE_ENV):
        return
    path = os.environ[LOG_FILE_ENV]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    original = os.fdopen(os.dup(2), "w", buffering=1)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    handler = logging.StreamHandler(original)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("gen_vllm").addHandler(handler)
