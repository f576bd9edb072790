"""The hand-off from a decoding thread to an event loop: once the consumer closed its stream
early and its loop is closed, the thread's last items and its final callback go nowhere and
raise nothing (an uncaught error there ended the thread with a traceback)."""

from __future__ import annotations

import asyncio

import pytest
from gen_backend_kit.threaded_rows import _Handoff


def test_items_and_the_final_callback_for_a_closed_loop_are_dropped():
    loop = asyncio.new_event_loop()
    queue: asyncio.Queue[int] = asyncio.Queue()
    handoff = _Handoff(loop, queue)
    handoff.put(1)
    loop.run_until_complete(asyncio.sleep(0))
    assert queue.get_nowait() == 1
    loop.close()
    called: list[int] = []
    handoff.put(2)
    handoff.flush_then(called.append, 3)
    assert called == [] and queue.empty()


def test_other_scheduling_errors_still_raise():
    class Refusing(asyncio.AbstractEventLoop):
        def call_soon_threadsafe(self, *args, **kwargs):
            raise RuntimeError("refused")

        def is_closed(self) -> bool:
            return False

    handoff = _Handoff(Refusing(), asyncio.Queue())
    with pytest.raises(RuntimeError, match="refused"):
        handoff.put(1)
