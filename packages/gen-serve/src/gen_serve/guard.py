"""``RequestGuard``: the draining, API key and body-size checks every request passes, as plain
ASGI.

A plain ASGI middleware rather than Starlette's ``BaseHTTPMiddleware``: that one runs every
response through an extra task and a memory stream, a cost paid on each chunk of every streamed
completion (the server's hottest path), for checks that only read the request's headers.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any

from gen_serve.errors import error_body
from gen_serve.runner import DRAINING_MESSAGE, RETRY_DRAINING_S

__all__ = ["RequestGuard"]

Scope = dict[str, Any]
Receive = Any
Send = Any
App = Any


class RequestGuard:
    """Refuses, before the application sees them, HTTP requests while the server drains (503
    with ``Retry-After`` and ``Connection: close``; not on ``draining_paths``), requests without
    the API key (401; not on ``open_paths``) and requests whose declared body exceeds
    ``max_body_bytes`` (413).

    Args:
        app: the application behind it.
        api_key: the key requests must bear as ``Authorization: Bearer <key>``; None: none.
        max_body_bytes: the largest ``Content-Length`` accepted.
        open_paths: paths the key does not guard.
        draining: whether the server is shutting down now (None: it never drains).
        draining_paths: paths still served while it drains.
    """

    def __init__(
        self,
        app: App,
        *,
        api_key: str | None,
        max_body_bytes: int,
        open_paths: frozenset[str],
        draining: Callable[[], bool] | None = None,
        draining_paths: frozenset[str] = frozenset(),
    ):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.open_paths = open_paths
        self.draining = draining
        self.draining_paths = draining_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if (
                self.draining is not None
                and self.draining()
                and scope.get("path") not in self.draining_paths
            ):
                await _respond(
                    send,
                    503,
                    DRAINING_MESSAGE,
                    [
                        (b"retry-after", str(RETRY_DRAINING_S).encode()),
                        (b"connection", b"close"),
                    ],
                )
                return
            refusal = self._refusal(scope)
            if refusal is not None:
                await _respond(send, *refusal)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        headers = dict(scope.get("headers") or ())
        if self.expected is not None and scope.get("path") not in self.open_paths:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return 401, "a valid API key is needed: Authorization: Bearer <key>"
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return 413, (
                f"the body is {int(length)} bytes; this server takes at most "
                f"{self.max_body_bytes} (--max-body-bytes)"
            )
        return None


async def _respond(
    send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
