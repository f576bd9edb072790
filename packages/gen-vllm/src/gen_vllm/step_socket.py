"""A worker's step stream over a local socket, for a driver on the worker's own node.

Each message of a worker's stream (a ``StepBatch`` in its wire form, ``gen_vllm.wire``) took
Ray's streaming generator 0.9 ms to reach the driver on this 2-core machine at 1 KB and
1.7 ms at 90 KB; a Unix socket carries the same messages in 0.2 and 0.3 ms. So a driver on
the worker's node reads the stream here, and Ray carries it only across nodes
(``ReplicaSet.outputs`` chooses). Ray still starts the worker and carries every control call.

The socket is in Linux's abstract namespace (no file to leave behind when a worker is killed;
it goes with the process). Any local process could connect to such a socket, so the worker
gives its name together with a random secret through Ray, and a connection that does not
send that secret first gets nothing. One reader at a time: a new connection ends the last one.

Frames: an 8-byte little-endian length, then that many bytes; a length of 0 is the stream's
clean end (the engine shut down). A connection that closes without it means the worker died.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import sys
from collections.abc import AsyncIterator

from gen_vllm import wire
from gen_vllm.step_feed import StepFeed

__all__ = ["StepSocketClosedError", "StepSocketServer", "read_step_socket", "supported"]

logger = logging.getLogger(__name__)

_LENGTH = 8
_SECRET_BYTES = 32
_HELLO_TIMEOUT_S = 30.0
_READ_LIMIT = 1 << 20  # the reader's buffer: a step of 256 finished rows is about 280 KB


class StepSocketClosedError(ConnectionError):
    """The worker's end closed without the stream's end: the worker died (or was killed)."""


def supported() -> bool:
    """Abstract Unix sockets are Linux's."""
    return sys.platform.startswith("linux")


class StepSocketServer:
    """The worker's end: serves ``feed`` to the one driver that knows the secret."""

    def __init__(self, feed: StepFeed):
        self._feed = feed
        self._server: asyncio.AbstractServer | None = None
        self._name = f"\0gen-vllm-steps-{os.getpid()}-{secrets.token_hex(8)}"
        self._secret = secrets.token_bytes(_SECRET_BYTES)
        self._sender: asyncio.Task[None] | None = None

    async def open(self) -> tuple[str, bytes]:
        """Listen (once; later calls give the same address): the socket's name and secret."""
        if self._server is None:
            self._server = await asyncio.start_unix_server(self._serve, path=self._name)
        return self._name, self._secret

    def close(self) -> None:
        """Stop listening; a connected reader gets the stream's end when the feed closes."""
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await asyncio.wait_for(reader.readexactly(_SECRET_BYTES), _HELLO_TIMEOUT_S)
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            writer.close()
            return
        if not hmac.compare_digest(hello, self._secret):
            logger.warning("a connection to this worker's step stream had the wrong secret")
            writer.close()
            return
        previous, self._sender = self._sender, asyncio.current_task()
        if previous is not None and not previous.done():
            previous.cancel()  # the driver reads anew (its last reader was given up)
        try:
            while (batch := await self._feed.take()) is not None:
                message = wire.encode(batch)
                writer.write(len(message).to_bytes(_LENGTH, "little"))
                writer.write(message)
                await writer.drain()
            writer.write(bytes(_LENGTH))  # the clean end
            await writer.drain()
        except ConnectionError:
            pass  # the driver went away; it reads anew if it still wants the stream
        finally:
            writer.close()


async def read_step_socket(name: str, secret: bytes) -> AsyncIterator[bytes]:
    """The messages of the worker's stream at ``name``, in order, until its clean end.

    Raises:
        StepSocketClosedError: the worker's end closed without the stream's end, or could not
            be reached.
    """
    try:
        reader, writer = await asyncio.open_unix_connection(name, limit=_READ_LIMIT)
    except OSError as exc:
        raise StepSocketClosedError(f"the worker's step stream cannot be reached: {exc}") from exc
    try:
        writer.write(secret)
        await writer.drain()
        while True:
            size = int.from_bytes(await reader.readexactly(_LENGTH), "little")
            if not size:
                return
            yield await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise StepSocketClosedError(
            f"the worker's step stream closed without its end ({type(exc).__name__})"
        ) from exc
    finally:
        writer.close()
