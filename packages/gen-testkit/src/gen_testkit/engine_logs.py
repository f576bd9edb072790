"""Keeping engines' and libraries' output off a command's terminal, in a log file instead.

The backends follow two environment variables (gen-vllm's and gen-sglang's ``logs`` modules):
``GEN_VERBOSE=1`` lets vLLM's, Ray's and SGLang's output reach the terminal; otherwise it is
appended to the file ``GEN_LOG_FILE`` names. A command calls ``route_engine_logs`` once, before
it starts a backend, and says where the file is.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import TextIO

from gen_backend_kit import run_logs
from gen_backend_kit.run_logs import LOG_FILE_ENV, VERBOSE_ENV

__all__ = ["LOG_FILE_ENV", "VERBOSE_ENV", "route_engine_logs", "verbose_requested"]


#: Warnings about a library's own future, never about what the user asked for: to the file.
_LIBRARY_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def verbose_requested() -> bool:
    """Whether ``GEN_VERBOSE`` asks for engine output on the terminal."""
    return run_logs.verbose()


def route_engine_logs(verbose: bool, name: str) -> Path | None:
    """Send the output of the engines this process starts, and of the libraries it uses, to a
    log file, unless ``verbose``.

    Exports ``GEN_VERBOSE=1`` when verbose; otherwise exports ``GEN_LOG_FILE`` (kept if already
    set, else ``<temp dir>/gen-logs/<name>-<time>-<pid>.log``), turns off transformers'
    progress bars and notices, and writes deprecation and future warnings to the file (other
    warnings still show). Returns the file, or None when verbose.
    """
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
        return None
    path = run_logs.log_file(name=name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    _quiet_transformers()
    _library_warnings_to(path)
    return path


def _quiet_transformers() -> None:
    """Through the variables transformers and huggingface_hub read at import (a user's own
    settings kept), and directly if transformers is imported already."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()


def _library_warnings_to(path: Path) -> None:
    show = warnings.showwarning

    def to_file(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if issubclass(category, _LIBRARY_WARNINGS):
            with open(path, "a") as handle:
                handle.write(warnings.formatwarning(message, category, filename, lineno, line))
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = to_file
