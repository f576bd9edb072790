"""``FleetClient``: HTTP requests to the fleet's SGLang servers, and what their failures mean.

A request goes to one server (``post``, ``chunks`` for a streamed ``/generate``), to each
serving server (``each_server``), or to any serving one (``post_anywhere``). A failure becomes
a typed error: a 400 is ``GenerationInputError`` (SGLang refused the request), another status
``GenerationError``; a request that failed on the way is ``ServerLostError`` when the server is
gone (its process exited, or nothing listens on its port), else ``GenerationError`` (it did not
answer in time). ``each_server`` and ``post_anywhere`` report a lost server to the fleet
(``ServerFleet.report_lost``: healing, it is left out; fail-stop, ``BackendBrokenError``);
``post`` and ``chunks`` raise ``ServerLostError`` to their caller, which reports it.

Thread-safe: the request threads share one connection pool.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Callable, Generator, Sequence
from typing import Any

import httpx
from gen_interface import GenerationError, GenerationInputError

from gen_sglang.fleet import ServerFleet, ServerLostError
from gen_sglang.server import SglangServer

__all__ = ["FleetClient"]


class FleetClient:
    """Requests to the servers of a fleet; see the module docstring.

    Args:
        fleet: gives the fleet whose servers are called (the fleet is made after the client:
            its replacements load and verify weights through it).
        timeout_s: how long a request may wait for an answer (``sglang_cfg.timeout_s``).
    """

    def __init__(self, fleet: Callable[[], ServerFleet[SglangServer]], timeout_s: float):
        self.fleet = fleet
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None),
        )

    def chunks(
        self, server: SglangServer, body: dict[str, Any]
    ) -> Generator[dict[str, Any], None, None]:
        """The parsed chunks of one streamed ``/generate``; closing the iterator ends the
        request (and its rows in SGLang).

        Raises:
            ServerLostError: the server is gone.
            GenerationInputError: SGLang refused the request (400).
            GenerationError: SGLang answered another error, or did not answer in time.
        """
        try:
            with (
                self.fleet().streaming(server) as progress,
                self._http.stream("POST", server.url + "/generate", json=body) as response,
            ):
                if response.status_code != 200:
                    response.read()
                    raise _refused(server, response)
                # Lines are split on b"\n" alone: the chunks' text may hold other characters
                # that count as line breaks in str.splitlines (U+2028, U+0085, ...).
                pending = b""
                for data in response.iter_bytes():
                    progress()
                    *lines, pending = (pending + data).split(b"\n")
                    for line in lines:
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            return
                        yield json.loads(payload)
        except httpx.HTTPError as exc:
            raise _lost(server, exc) from exc

    def post(
        self,
        server: SglangServer,
        route: str,
        body: Any,
        *,
        json_answer: bool = True,
    ) -> Any:
        """POST ``body`` to ``server``'s ``route``: the parsed answer (``json_answer``) or its
        text.

        Raises:
            ServerLostError: the server is gone.
            GenerationInputError: SGLang refused the request (400).
            GenerationError: SGLang answered another error, or did not answer in time.
        """
        try:
            response = self._http.post(server.url + route, json=body)
        except httpx.HTTPError as exc:
            raise _lost(server, exc) from exc
        if response.status_code != 200:
            raise _refused(server, response)
        return response.json() if json_answer else response.text

    def each_server(
        self,
        route: str,
        body: Any,
        *,
        json_answer: bool = True,
        replicas: Sequence[int] | None = None,
    ) -> None:
        """Send one request to each serving server (or to ``replicas``, those of them still
        serving); a server found lost is reported (healing: it is left out).

        Raises:
            BackendBrokenError: a server was lost (fail-stop).
            GenerationError: a serving server answered an error.
        """
        fleet = self.fleet()
        for replica in fleet.members() if replicas is None else replicas:
            server = fleet.servers[replica]
            if not fleet.is_member(replica, server):
                continue  # lost since the list was made
            try:
                self.post(server, route, body, json_answer=json_answer)
            except ServerLostError as exc:
                fleet.report_lost(replica, exc)

    def post_anywhere(self, route: str, body: Any) -> Any:
        """``post`` to the first serving server, the next one if it is lost on the way.

        Raises:
            NoReplicaServingError: no server serves (healing).
            BackendBrokenError: the server was lost (fail-stop).
        """
        fleet = self.fleet()
        while True:
            members = fleet.members()
            if not members:
                raise fleet.no_replica_serving()
            server = fleet.servers[members[0]]
            try:
                return self.post(server, route, body)
            except ServerLostError as exc:
                fleet.report_lost(members[0], exc)

    def close(self) -> None:
        """Close the connections; no request may follow."""
        self._http.close()


def _lost(server: SglangServer, exc: BaseException) -> GenerationError:
    """The error for a request that failed on the way: ``ServerLostError`` when the server is
    gone (its process exited, or nothing listens on its port), else it did not answer in
    time."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.process.wait(timeout=3.0)  # a killed server's connections close first
    died = server.died()
    if died is not None:
        return ServerLostError(f"{died} during a request:\n{server.log_tail()}", server)
    if isinstance(exc, httpx.ConnectError):
        return ServerLostError(
            f"the SGLang server ({server.name}, pid {server.process.pid}) runs but refuses "
            f"connections: {exc!r}",
            server,
        )
    return GenerationError(f"SGLang ({server.name}) did not answer: {exc!r}")


def _refused(server: SglangServer, response: httpx.Response) -> GenerationError:
    text = response.text[:1000]
    if response.status_code == 400:
        return GenerationInputError(f"SGLang ({server.name}) refused the request: {text}")
    return GenerationError(f"SGLang ({server.name}) answered {response.status_code}: {text}")
