"""Wait for the machine to go quiet before a timed run.

The benchmarks interleave runs of different servers or engines on one machine, and a run can
leave work running after it returns. vLLM's multiprocess executor does: its worker polls its
shared-memory message queue at full speed for a second after the last message it read
(``busy_loop_s=1`` of ``vllm.distributed.device_communicators.shm_broadcast.MessageQueue``).
Measured after 64 streamed requests to ``vllm serve`` on two cores, the machine stays at one
full core for about 0.9 s. Whatever runs next starts with half the machine taken, and at a
fast step speed that covers most of its run. ``wait_until_quiet`` before every timed run gives
each side the whole machine, as each has it when it serves alone.
"""

from __future__ import annotations

import time

import psutil

__all__ = ["wait_until_quiet"]


def wait_until_quiet(
    busy_below: float = 0.2, window_s: float = 0.25, at_most_s: float = 10.0
) -> float:
    """Block until the whole machine's CPU use over one ``window_s`` falls below
    ``busy_below`` (a fraction of all cores), or ``at_most_s`` passed; returns the seconds
    waited. Prints a line when the machine never went quiet (the run that follows shares it)."""
    start = time.monotonic()
    psutil.cpu_percent(None)  # starts the first window
    while True:
        time.sleep(window_s)
        busy = psutil.cpu_percent(None) / 100
        waited = time.monotonic() - start
        if busy < busy_below:
            return waited
        if waited >= at_most_s:
            print(
                f"  (the machine stayed busy for {waited:.1f} s, {busy:.0%} of its cores in "
                "the last window: the next run shares it)",
                flush=True,
            )
            return waited
