"""A backend's shutdown ends the calls still running on their threads and waits for them."""

from __future__ import annotations

import threading
import time

from gen_backend_kit.stepping import RowControl
from gen_backend_kit.threaded_rows import CallThreads


def test_stop_cancels_running_calls_and_waits_for_their_threads():
    threads = CallThreads()
    control = RowControl()
    started, ended = threading.Event(), threading.Event()

    def decode() -> None:  # a decode loop that checks its control between steps
        started.set()
        while not control.cancelled.is_set():
            time.sleep(0.01)
        time.sleep(0.2)  # the step in progress ends after the cancel
        ended.set()

    threads.start(decode, control, "decode-call")
    assert started.wait(5)
    assert threads.stop(timeout_s=10) == []
    assert ended.is_set(), "stop returned before the call's thread ended"
    assert threads.stop(timeout_s=0) == [], "an ended thread is no longer held"


def test_stop_names_the_threads_still_running_past_its_bound():
    threads = CallThreads()
    release = threading.Event()
    threads.start(lambda: release.wait(10), RowControl(), "stuck-call")
    assert threads.stop(timeout_s=0.1) == ["stuck-call"]
    release.set()
    assert threads.stop(timeout_s=10) == []
