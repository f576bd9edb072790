"""``ServerFleet``: gen-sglang's servers as a healing fleet: losses noticed, replacements started,
loaded and admitted.

The health itself is the kit's ``FleetHealth`` (one state machine, shared with gen-vllm); this
is what gen-sglang does at each transition:

- **Lost** (``lose``: a request whose connection failed, or the watch thread finding a server's
  process gone or the server wedged: requests streaming from it (``streaming``) and nothing
  sent on any of them for ``wedge_timeout_s``, outside weight updates): the server is marked
  dead and stopped (its session killed, its files removed; a wedged server's requests then fail
  as a dead one's do, and their rows move),
  and with ``sglang_cfg.healing`` a replacement starts on a thread while restarts are left
  (``sglang_cfg.max_replica_restarts``). Without healing the first loss breaks the backend
  (``BackendBrokenError``, raised by ``report_lost`` to whoever found the loss), as before.
- **Replacement**: a new server process (``restarting``) until it answers ``/health_generate``,
  then ``stale``. It takes the fleet's current weights: while no update has committed it holds
  them already (it loaded the checkpoint, as the others did); after one, it loads the staged
  checkpoint in shared memory (``checkpoint.StagedCheckpoint``), which holds the last committed
  weights whole from the commit until the next update writes into it (every update is complete,
  and each tensor was verified against the trainer's checksum as it was written). An update
  that wrote into it and was then dropped leaves it holding weights no server serves: a
  replacement then waits, stale, for the next commit.
- **Admission**: only when its weight checksum (SGLang's ``/weights_checker``, over every
  parameter as the server holds it) equals a serving peer's, while no update is open; it then
  serves at the fleet's version. With no peer serving, the checksum seen last at the fleet's
  version stands in; with none seen, the replacement is admitted on its source alone (a log
  line says so) and its checksum becomes the fleet's. A replacement that fails to start, load or
  verify is stopped and the slot is dead again; another follows while restarts are left.
- **Updates** run on the members of their start (``begin_update``); a member lost meanwhile is
  dropped from it; a replacement waits for the update to end, then loads its result.

Thread-safe: request threads, the watch thread and replacement threads all report here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from gen_backend_kit.fleet_health import FleetHealth, ReplicaState
from gen_interface import (
    BackendBrokenError,
    GenerationError,
    MixedWeightsError,
    NoReplicaServingError,
)

__all__ = ["FleetServer", "ServerFleet", "ServerLostError"]

logger = logging.getLogger(__name__)

#: How often the watch thread looks at the servers' processes.
WATCH_PERIOD_S = 0.5
_POLL_S = 0.05


class FleetServer(Protocol):
    """What the fleet needs of a server (``server.SglangServer``)."""

    name: str

    def wait_ready(self, timeout_s: float) -> None: ...

    def died(self) -> str | None: ...

    def stop(self) -> None: ...


S = TypeVar("S", bound=FleetServer)


@dataclass
class _Streams:
    """A server's requests streaming now, and when any of them last received bytes."""

    open: int
    last: float


class ServerLostError(GenerationError):
    """A request failed because its server is gone (its process exited, or its connection
    broke). The backend's own signal: in a healing fleet its rows move, otherwise it becomes
    ``BackendBrokenError``.

    Attributes:
        server: the server that was lost.
    """

    def __init__(self, message: str, server: FleetServer):
        super().__init__(message)
        self.server = server


class ServerFleet(Generic[S]):
    """``servers`` (all serving at first) as a fleet; see the module docstring.

    Args:
        servers: the running servers, one per replica.
        health: the state machine, sized ``len(servers)``.
        healing: replace lost servers (False: fail-stop; losses are only recorded).
        launch: start replica ``i``'s replacement process (returns at once).
        start_timeout_s: how long a replacement may take to answer.
        wedge_timeout_s: healing: the longest a server with requests streaming may send
            nothing on all of them (outside updates) before it is taken as wedged and lost.
        load: load the staged checkpoint into a server, labelled with a version.
        checksum: a server's weight checksum.
        prepare: called on a replacement just before it is admitted, with no update open and
            no loss reported meanwhile (a backend asleep puts it to sleep too).
        weights_absent: the fleet started without its checkpoint (``load_format: dummy``), so
            there is nothing to verify until an update commits.
    """

    def __init__(
        self,
        servers: Sequence[S],
        health: FleetHealth,
        *,
        healing: bool,
        launch: Callable[[int], S],
        start_timeout_s: float,
        wedge_timeout_s: float = 30.0,
        load: Callable[[S, int], None],
        checksum: Callable[[S], str],
        prepare: Callable[[S], None] = lambda server: None,
        weights_absent: bool = False,
    ):
        if len(servers) != health.size:
            raise ValueError(f"{len(servers)} servers for a fleet of {health.size}")
        self.servers = list(servers)
        self.health = health
        self.healing = healing
        self.version = 0  # the fleet's committed weight version
        self.faults = 0  # servers lost
        self.rows_rerun = 0  # rows moved from a lost server and run again on another
        self.rows_lost = 0  # rows that had streamed tokens when their server was lost
        self.heal_seconds: list[float] = []  # from each loss to its replacement's admission
        self._launch = launch
        self._start_timeout_s = start_timeout_s
        self._wedge_s = wedge_timeout_s
        self._streams: dict[int, _Streams] = {}  # by id() of a server with requests streaming
        self._load = load
        self._checksum = checksum
        self._prepare = prepare
        self._absent = weights_absent
        self._checkpoint_current = True  # no update committed: the checkpoint is the weights
        self._staged_current = False  # the staged checkpoint holds the committed weights
        self._known: dict[int, str] = {}  # the fleet's weight checksum, by version
        self._updating = False
        self._warned_stale_copy = False
        self._lock = threading.RLock()  # the servers, losses, replacements starting
        self._update_lock = threading.Lock()  # updates against admissions
        self._lost_at: dict[int, float] = {}
        self._starting: dict[int, S] = {}  # replacements not yet admitted
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self._watch: threading.Thread | None = None
        if healing:
            self._watch = threading.Thread(target=self._watch_loop, name="fleet-watch", daemon=True)
            self._watch.start()

    # ---- routing ---------------------------------------------------------------------------

    def members(self) -> list[int]:
        """The replicas that take rows and updates now."""
        return self.health.serving()

    def is_member(self, replica: int, server: FleetServer) -> bool:
        """``server`` is replica ``replica``'s and takes rows (not lost, not replaced since)."""
        return self.servers[replica] is server and self.health.takes_rows(replica)

    def no_replica_serving(self) -> NoReplicaServingError:
        m = self.health.metrics()
        return NoReplicaServingError(
            f"no SGLang server of the fleet serves: {m['fleet_replicas_dead']} dead, "
            f"{m['fleet_replicas_restarting'] + m['fleet_replicas_stale']} being replaced, "
            f"{self.health.restarts_left} restart(s) left (sglang_cfg.max_replica_restarts); "
            "retry once a replacement serves"
        )

    # ---- losses ----------------------------------------------------------------------------

    def lose(self, replica: int, server: FleetServer, why: str) -> bool:
        """``server``, replica ``replica``'s, is gone: dead, and while healing stopped and
        replaced. False when that was known already (a dead connection and the watch thread
        report one loss twice) or ``server`` was replaced since."""
        with self._lock:
            if self._closed.is_set() or self.servers[replica] is not server:
                return False
            if not self.health.takes_rows(replica) or not self.health.kill(replica, why):
                return False
            self.faults += 1
            self._lost_at[replica] = time.monotonic()
        logger.warning("SGLang %s is dead: %s", server.name, why)
        if self.healing:
            self._spawn(server.stop, f"stop-{replica}")
            self._maybe_replace(replica)
        return True

    def report_lost(self, replica: int, error: ServerLostError) -> None:
        """A request found replica ``replica``'s server lost (``error``): ``lose`` it. Healing,
        it is replaced and this returns; fail-stop, the backend is broken.

        Raises:
            BackendBrokenError: fail-stop (``sglang_cfg.healing: false``).
        """
        self.lose(replica, error.server, str(error))
        if not self.healing:
            raise BackendBrokenError(str(error)) from error

    def _watch_loop(self) -> None:
        while not self._closed.wait(WATCH_PERIOD_S):
            for replica in self.members():
                server = self.servers[replica]
                died = server.died()
                if died is not None:
                    self.lose(replica, server, died)
            for replica, server, why in self._wedged():
                self.lose(replica, server, why)

    def _maybe_replace(self, replica: int) -> None:
        if self._closed.is_set() or not self.health.may_restart(replica):
            return
        self.health.move(replica, ReplicaState.RESTARTING, "a replacement is starting")
        self._spawn(lambda: self._replace(replica), f"replace-replica-{replica}")

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    @contextlib.contextmanager
    def streaming(self, server: FleetServer) -> Iterator[Callable[[], None]]:
        """A request to ``server`` streams inside the block: call the function it gives each
        time bytes arrive. A server whose streaming requests all go silent for
        ``wedge_timeout_s`` (outside updates) is wedged: the watch thread loses it."""
        key = id(server)
        with self._lock:
            streams = self._streams.get(key)
            if streams is None:
                streams = self._streams[key] = _Streams(0, time.monotonic())
            streams.open += 1

        def progress() -> None:
            streams.last = time.monotonic()

        try:
            yield progress
        finally:
            with self._lock:
                streams.open -= 1
                if streams.open == 0:
                    self._streams.pop(key, None)

    def _wedged(self) -> list[tuple[int, S, str]]:
        """Members whose streaming requests have all been silent past the bound."""
        if self._updating:
            return []
        now = time.monotonic()
        found = []
        with self._lock:
            for replica in self.members():
                server = self.servers[replica]
                streams = self._streams.get(id(server))
                if streams is not None and now - streams.last > self._wedge_s:
                    found.append(
                        (
                            replica,
                            server,
                            f"wedged: {streams.open} request(s) streaming from it and nothing "
                            f"sent for {now - streams.last:.1f} s (sglang_cfg.wedge_timeout_s "
                            f"{self._wedge_s:g})",
                        )
                    )
        return found

    # ---- updates ---------------------------------------------------------------------------

    def begin_update(self) -> list[int]:
        """An update starts on the members of now (returned); replacements wait for its end."""
        with self._update_lock:
            self._updating = True
            return self.members()

    def no_admissions(self) -> AbstractContextManager[object]:
        """Hold replacements out while the block runs (the backend goes to sleep or wakes)."""
        return self._update_lock

    def staged_written(self) -> None:
        """The update wrote into the staged checkpoint: it no longer holds the committed
        weights until the update commits."""
        self._staged_current = False

    def committed(self, version: int) -> None:
        """The update committed as ``version`` on every member."""
        with self._update_lock:
            self.version = version
            self._checkpoint_current = self._absent = False
            self._staged_current = True
            self._warned_stale_copy = False
            self._known.pop(version, None)
            self.health.set_version(version)

    def update_ended(self) -> None:
        """The update committed or was dropped: replacements may load and be admitted, and
        the wedge bound counts again from now (generation was held while it ran)."""
        with self._update_lock:
            self._updating = False
        with self._lock:
            now = time.monotonic()
            for streams in self._streams.values():
                streams.last = now

    # ---- replacements ----------------------------------------------------------------------

    def _replace(self, replica: int) -> None:
        while not self._closed.is_set():
            server: S | None = None
            try:
                server = self._launch(replica)
                with self._lock:
                    self._starting[replica] = server
                if self._closed.is_set():
                    raise GenerationError("the backend shut down")
                server.wait_ready(self._start_timeout_s)
                self.health.move(replica, ReplicaState.STALE, "server up, weights unverified")
                self._admit(replica, server)
                return
            except Exception as exc:
                if server is not None:
                    server.stop()
                with self._lock:
                    self._starting.pop(replica, None)
                if self._closed.is_set():
                    return
                if not self.health.replacement_failed(replica, str(exc)):
                    return

    def _admit(self, replica: int, server: S) -> None:
        """Bring ``server`` to the fleet's weights, verify them and admit it.

        Raises:
            GenerationError: the load failed, or the weights did not verify.
        """
        while True:
            if self._closed.is_set():
                raise GenerationError("the backend shut down")
            with self._update_lock:
                if not self._updating and (self._checkpoint_current or self._staged_current):
                    version = self.version
                    source = "its checkpoint"
                    if not self._checkpoint_current:
                        source = f"the staged copy of version {version}"
                        self._load(server, version)
                    self._verify(replica, server, version, source)
                    with self._lock:
                        self._prepare(server)
                        self.servers[replica] = server
                        self._starting.pop(replica, None)
                        self.health.admit(replica, version)
                        lost_at = self._lost_at.pop(replica, None)
                    if lost_at is not None:
                        self.heal_seconds.append(time.monotonic() - lost_at)
                    logger.info("%s replaced, serving at weight version %d", server.name, version)
                    return
                if not self._updating and not self._warned_stale_copy:
                    self._warned_stale_copy = True
                    logger.warning(
                        "replica %d waits for the next committed weight update: the staged "
                        "copy of version %d was overwritten by an update that was dropped",
                        replica,
                        self.version,
                    )
            time.sleep(_POLL_S)

    def _verify(self, replica: int, server: S, version: int, source: str) -> None:
        if self._absent:
            return  # no real weights yet, and none generate until an update commits
        mine = self._checksum(server)
        reference, peer_name = self._known.get(version), "the fleet's last seen"
        for peer in self.members():
            peer_server = self.servers[peer]
            try:
                reference, peer_name = self._checksum(peer_server), peer_server.name
                break
            except ServerLostError as exc:
                self.lose(peer, peer_server, str(exc))
        if reference is None:
            logger.info(
                "no server serves to compare replica %d's weights with: admitted on its source "
                "(%s); its checksum is now the fleet's",
                replica,
                source,
            )
            reference = mine
        self._known[version] = reference
        if mine != reference:
            raise MixedWeightsError(
                f"the replacement of replica {replica}, loaded from {source}, does not hold "
                f"the weights {peer_name} serves at version {version} (checksum {mine} against "
                f"{reference})"
            )

    # ---- reading, closing ------------------------------------------------------------------

    def metrics(self) -> dict[str, int | float]:
        """The health's metrics, the losses seen, rows re-run or lost, and healing times."""
        heal = self.heal_seconds
        return {
            **self.health.metrics(),
            "fleet_faults_total": self.faults,
            "fleet_rows_rerun_total": self.rows_rerun,
            "fleet_rows_lost_total": self.rows_lost,
            "fleet_heal_seconds_last": heal[-1] if heal else 0.0,
            "fleet_heal_seconds_max": max(heal) if heal else 0.0,
        }

    def settled(self) -> bool:
        """No replacement is under way."""
        return self.health.settled(replacements_due=not self._closed.is_set())

    def wait_settled(self, timeout_s: float) -> bool:
        """Wait until no replacement is under way; whether that happened within ``timeout_s``."""
        return self.health.wait_settled(timeout_s, _POLL_S, closed=self._closed)

    def close(self) -> None:
        """Stop watching and replacing; stop replacements not yet admitted and wait for the
        fleet's threads (the backend then stops the servers it holds)."""
        self._closed.set()
        if self._watch is not None:
            self._watch.join(timeout=5.0)
        with self._lock:
            starting = list(self._starting.values())
        for server in starting:
            server.stop()
        for thread in list(self._threads):
            thread.join(timeout=10.0)
        with self._lock:
            starting, self._starting = list(self._starting.values()), {}
        for server in starting:  # one launched while the others were joined
            server.stop()
