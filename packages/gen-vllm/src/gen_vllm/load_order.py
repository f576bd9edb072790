"""The loads of one weight update, let into a worker's engine in the order the driver sent them.

The driver hands a load to the workers while the previous one still runs, so the engine never
waits for a call between two loads. Ray may start an async actor's calls out of order, so each
load carries its place in the update (0, 1, ...) and waits here until those before it are
queued: every replica loads in the same order, which its report's ``received_checksum`` records.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from gen_interface import WeightUpdateError

__all__ = ["LoadOrder"]


class LoadOrder:
    """Turns of the loads of the update in progress. Used on one event loop (the actor's)."""

    def __init__(self) -> None:
        self._changed: asyncio.Condition | None = None  # made on the event loop, when first used
        self._queued = 0  # loads of this update let through so far
        self._update = 0  # updates started

    async def new_update(self) -> None:
        """Loads count from 0 again; a load still waiting from the last update fails."""
        changed = self._condition()
        async with changed:
            self._update += 1
            self._queued = 0
            changed.notify_all()

    @contextlib.asynccontextmanager
    async def turn(self, order: int) -> AsyncIterator[None]:
        """Wait until the loads before ``order`` were let through; the body queues this one.

        Raises:
            WeightUpdateError: the update ended while this load waited (one before it never
                came); nothing of it was written.
        """
        update = self._update
        changed = self._condition()
        async with changed:
            await changed.wait_for(lambda: self._queued >= order or self._update != update)
            if self._update != update:
                raise WeightUpdateError(
                    f"load {order} of a weight update arrived after that update ended (a load "
                    "before it never came): nothing of it was written"
                )
            try:
                yield
            finally:
                self._queued = max(self._queued, order + 1)
                changed.notify_all()

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed
