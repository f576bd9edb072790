"""``InThread``: one call run on a thread of its own while a check does something beside it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["InThread"]


class InThread:
    """Runs ``fn`` on a (daemon) thread; ``done`` is set once it returned or raised, and
    ``result(timeout_s)`` returns what it returned or raises what it raised."""

    def __init__(self, fn: Callable[[], Any]):
        self.done = threading.Event()
        self._outcome: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                self._outcome.append((True, fn()))
            except BaseException as exc:
                self._outcome.append((False, exc))
            finally:
                self.done.set()

        threading.Thread(target=run, daemon=True).start()

    def result(self, timeout_s: float) -> Any:
        """What ``fn`` returned; fails the check when it did not finish within ``timeout_s``."""
        assert self.done.wait(timeout_s), f"the call did not finish within {timeout_s} s"
        ok, value = self._outcome[0]
        if not ok:
            raise value
        return value
