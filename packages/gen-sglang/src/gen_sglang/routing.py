"""``RowRouter``: a call's rows spread over the fleet's serving servers, and moved off a server
lost under them.

The rows go round the serving servers from where the last call stopped, one batched request per
server (so SGLang schedules a call's rows together), each on a request thread of the router's
own. A server lost under its request (``ServerLostError``) is reported to the fleet
(``ServerFleet.report_lost``); healing, its rows that had handed the caller nothing run again at
once on the serving servers, and rows that had streamed tokens end the call with
``RowLostError`` (their tokens so far stand, and another server cannot continue them without
contradicting them). Any other failure stops the other requests and is raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

from gen_interface import RowLostError

from gen_sglang.fleet import ServerFleet, ServerLostError
from gen_sglang.server import SglangServer

__all__ = ["RowRouter"]

#: Requests in flight at once per backend (each a call's rows on one server).
MAX_REQUESTS_IN_FLIGHT = 64


class RowRouter:
    """Runs calls' rows on ``fleet``'s serving servers; see the module docstring.

    Args:
        fleet: gives the fleet whose servers run the rows, and where losses are reported (the
            backend makes the router before its fleet, as it does the client).
        max_in_flight: requests running at once (the request threads).
    """

    def __init__(
        self,
        fleet: Callable[[], ServerFleet[SglangServer]],
        max_in_flight: int = MAX_REQUESTS_IN_FLIGHT,
    ):
        self.fleet = fleet
        self._pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="gen-sglang")
        self._next = 0  # where the next call's rows start, counted over the members
        self._next_lock = threading.Lock()

    def run(
        self,
        work: Callable[[SglangServer, list[int]], None],
        count: int,
        stop: threading.Event,
        unfinished: Callable[[list[int]], tuple[list[int], list[int]]],
    ) -> None:
        """Spread rows ``0 .. count - 1`` over the serving servers and run ``work(server, its
        rows)`` for each on the request threads.

        A server lost under its request (healing): ``unfinished(its rows)`` says which of them
        handed the caller nothing (they run again at once on the serving servers) and which
        streamed tokens already (the call ends with ``RowLostError`` naming them). Any other
        failure ends the others (through ``stop``) and is raised.

        Raises:
            NoReplicaServingError: no server serves (healing), at the start or when rows move.
            RowLostError: rows that had streamed tokens were on a server that was lost.
            BackendBrokenError: a server was lost (fail-stop).
        """
        fleet = self.fleet()
        running: dict[Future[None], tuple[int, SglangServer, list[int]]] = {}

        def send(rows: list[int]) -> None:
            members = fleet.members()
            if not members:
                raise fleet.no_replica_serving()
            with self._next_lock:
                first = self._next % len(members)
                self._next = first + len(rows)
            shares: dict[int, list[int]] = {}
            for k, index in enumerate(rows):
                shares.setdefault(members[(first + k) % len(members)], []).append(index)
            for replica, share in shares.items():
                server = fleet.servers[replica]
                running[self._pool.submit(work, server, share)] = (replica, server, share)

        try:
            send(list(range(count)))
            while running:
                done, _ = wait(running, return_when=FIRST_EXCEPTION)
                for future in done:
                    replica, server, rows = running.pop(future)
                    error = future.exception()
                    if error is None:
                        continue
                    if not isinstance(error, ServerLostError):
                        raise error
                    fleet.report_lost(replica, error)
                    rerun, lost = unfinished(rows)
                    if lost:
                        fleet.rows_lost += len(lost)
                        raise RowLostError(
                            f"row(s) {lost} had already streamed tokens when SGLang "
                            f"({server.name}) was lost ({error}): their tokens so far stand, "
                            "the rest cannot be made elsewhere without contradicting them; run "
                            "those rows again (the same seed gives the same tokens)",
                            tuple(lost),
                        )
                    if rerun:
                        fleet.rows_rerun += len(rerun)
                        send(rerun)
        finally:
            if running:
                stop.set()
                wait(running)

    def close(self) -> None:
        """Stop the request threads; requests not started are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
