"""``Wire``: HTTP to one server, on an event loop of its own.

Every request runs on one event loop in a daemon thread, whatever calls it: a blocking
``generate`` on any thread, or an ``async for`` on the caller's own loop (a new loop per
``asyncio.run``, as often as not). One ``httpx.AsyncClient`` on that loop keeps its connections
alive between calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import httpx

from gen_remote.errors import error_from_answer, error_from_transport

__all__ = ["Wire"]

T = TypeVar("T")


class Wire:
    """Requests to the server at ``base_url``.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``.
        api_key: sent as ``Authorization: Bearer``; None: nothing sent.
        connect_timeout_s: how long connecting may take.
        timeout_s: the longest silence within one call (None: no limit).
        max_connections: connections at most; further requests wait for one.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        connect_timeout_s: float = 5.0,
        timeout_s: float | None = 600.0,
        max_connections: int = 256,
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="gen-remote-wire", daemon=True
        )
        self._thread.start()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s, pool=None)
        # every connection stays open for the next call: a burst of rows reuses them instead of
        # reconnecting (and nothing is allocated anew per call)
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )

        async def client() -> httpx.AsyncClient:
            return httpx.AsyncClient(
                base_url=self.base_url, headers=headers, timeout=timeout, limits=limits
            )

        self._client = self.run(client())
        self._closed = False

    # ---- running coroutines on the wire's loop -------------------------------------------

    def submit(self, work: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``work`` on the wire's loop; cancelling the future cancels it."""
        return asyncio.run_coroutine_threadsafe(work, self._loop)

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` on the wire's loop and wait for its result (from any other thread)."""
        return self.submit(work).result()

    async def run_async(self, work: Coroutine[Any, Any, T]) -> T:
        """Await ``work`` run on the wire's loop, from another event loop."""
        return await asyncio.wrap_future(self.submit(work))

    # ---- requests (coroutines of the wire's loop) ----------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, Any] | None = None,
    ) -> Any:
        """One request; its JSON answer (``{}`` when empty).

        Raises:
            GenerationError (or a subclass), NotImplementedError: what the answer says, or that
                none came (``errors``).
        """
        where = f"{self.base_url}{path}"
        try:
            response = await self._client.request(
                method, path, json=body, params=params, follow_redirects=False
            )
        except httpx.HTTPError as exc:
            raise error_from_transport(exc, where, self.timeout_s) from exc
        if response.status_code >= 400:
            raise error_from_answer(response.status_code, _parsed(response.text), where)
        return _parsed(response.text) if response.content else {}

    async def stream(self, path: str, body: Any) -> AsyncIterator[Any]:
        """POST ``body`` and yield each server-sent event's JSON, up to ``[DONE]``.

        Raises:
            GenerationError (or a subclass): an error answer, an error event inside the stream,
                or a stream that broke off.
        """
        where = f"{self.base_url}{path}"
        try:
            async with self._client.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    text = (await response.aread()).decode(errors="replace")
                    raise error_from_answer(response.status_code, _parsed(text), where)
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if isinstance(event, dict) and "error" in event:
                        raise error_from_answer(500, event, where)
                    yield event
        except httpx.HTTPError as exc:
            raise error_from_transport(exc, where, self.timeout_s) from exc

    # ---- blocking helpers ----------------------------------------------------------------

    def call(
        self, method: str, path: str, body: Any = None, params: dict[str, Any] | None = None
    ) -> Any:
        """``request`` from a thread that is not the wire's."""
        return self.run(self.request(method, path, body, params))

    def close(self) -> None:
        """Close the connections and stop the loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.run(self._client.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)


def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
