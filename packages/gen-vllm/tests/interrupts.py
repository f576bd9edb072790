"""Ctrl-C for interrupted-call tests, independent of timing and of the process's SIGINT setup.

A timer that sends SIGINT after a fixed delay makes such a test depend on the machine's load
(the signal may come before the call waits, or after it returned) and on how SIGINT is handled
in the test process: a shell's background job starts with SIGINT ignored, and Python then
installs no handler, so nothing is raised ("DID NOT RAISE KeyboardInterrupt"). Here Python's
own handler is installed for the duration, and the signal is sent only once the main thread
is blocked inside the given function.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import CodeType
from typing import Any

__all__ = ["ctrl_c_while_waiting_in"]


def _waiting_in(thread_id: int, code: CodeType) -> bool:
    """Whether ``thread_id`` is blocked (in a ``wait``) within a call of ``code``."""
    frame = sys._current_frames().get(thread_id)
    if frame is None or frame.f_code.co_name != "wait":
        return False
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def ctrl_c_while_waiting_in(
    function: Callable[..., Any],
    when: Callable[[], bool] = lambda: True,
    timeout_s: float = 300.0,
) -> Iterator[threading.Event]:
    """Within the block, SIGINT reaches this process once the main thread waits inside
    ``function`` and ``when()`` holds (Python's default SIGINT handler installed meanwhile, so
    it raises ``KeyboardInterrupt`` there). Yields an event set when the signal was sent. Call
    from the main thread."""
    code = function.__code__
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main, "call from the main thread"
    sent = threading.Event()
    done = threading.Event()

    def deliver() -> None:
        deadline = time.monotonic() + timeout_s
        while not done.is_set() and time.monotonic() < deadline:
            if _waiting_in(main, code) and when():
                sent.set()
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.005)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    sender = threading.Thread(target=deliver, name="ctrl-c", daemon=True)
    sender.start()
    try:
        yield sent
    finally:
        done.set()
        sender.join()
        signal.signal(signal.SIGINT, previous)
