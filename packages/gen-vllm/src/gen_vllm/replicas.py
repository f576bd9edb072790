"""``ReplicaSet``: the Ray actors of one ``VllmGeneration`` and every call that reaches them.

Each worker method has a method here of the same name, so call sites are plain, typed method
calls. Calls to all replicas run concurrently and wait on all of them within a bounded time, so a
dead or stuck worker is noticed in seconds, and Ray's errors become the interface's errors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gen_interface import BackendBrokenError, BackendUnavailableError, GenerationError, InFlight
from gen_interface.weights import WeightBase
from gen_interface.weights.collective import CollectiveEndpoint

from gen_vllm import step_socket
from gen_vllm.cluster import Bundle, RayVirtualCluster, ray_reachable
from gen_vllm.engine import EngineFactory
from gen_vllm.logs import log_file, verbose, worker_env
from gen_vllm.messages import RowRequest, UpdateReport, WorkerInfo
from gen_vllm.receive import LoadInfo
from gen_vllm.worker import VllmGenerationWorker

__all__ = ["ReplicaSet", "Timeouts", "WorkerLostError", "kill_actor", "translate_ray_error"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_PROGRESS_EVERY_S = 15.0
_SHUTDOWN_GRACE_S = 15.0


class WorkerLostError(BackendBrokenError):
    """A worker died or stopped answering: its engine's state is unknown from now on."""


@dataclass(frozen=True)
class Timeouts:
    """How long each kind of call may take, in seconds."""

    startup_s: float = 900.0
    generate_s: float = 3600.0
    update_s: float = 900.0
    control_s: float = 300.0  # sleep, wake, cache resets, scoring probes


@dataclass(frozen=True)
class _Launch:
    """What starting one replica's actor takes: kept to start a replacement in its place."""

    remote_cls: Any
    cluster: RayVirtualCluster
    groups: list[list[Bundle]]
    name_prefix: str
    model: str
    engine_args: dict[str, Any]
    engine_factory: EngineFactory | None
    env: Mapping[str, str]
    cpu_threads: int | None


@dataclass
class ReplicaSet:
    """Handles of the running ``VllmGenerationWorker`` actors, in replica order.

    Calls that reach every replica (life cycle, weights, scoring, counting rows) reach the
    members only: every replica, unless ``members`` was set (a healing fleet sets it to the
    replicas that take rows, ``FleetHealth.serving``); the lists they return follow
    ``member_ids()``.
    """

    actors: list[Any]
    timeouts: Timeouts = field(default_factory=Timeouts)
    infos: list[WorkerInfo] = field(default_factory=list)
    #: Which replicas calls to "every replica" reach (None: all).
    members: Callable[[], list[int]] | None = None
    #: While a weight update is open, the members it started on: it ends on the same ones.
    pinned: list[int] | None = None
    launch: _Launch | None = None
    #: A call outlived its timeout: some worker may be stuck, so ``shutdown`` kills at once
    #: instead of waiting for workers to stop their engines.
    stuck: bool = False
    #: Loads handed to the workers in the update in progress: the next one's place in order.
    loads_sent: int = 0
    #: The actor of each replica that joined the last weight group (``init_collective``).
    _weight_group: dict[int, Any] = field(default_factory=dict, init=False, repr=False)

    def __len__(self) -> int:
        return len(self.actors)

    @classmethod
    def start(
        cls,
        cluster: RayVirtualCluster,
        model: str,
        engine_args: dict[str, Any],
        *,
        tensor_parallel_size: int,
        name_prefix: str,
        timeouts: Timeouts,
        engine_factory: EngineFactory | None = None,
        env: Mapping[str, str] | None = None,
        cpu_threads: int | None = None,
    ) -> ReplicaSet:
        """Start one actor per engine group of the cluster and wait until every engine is up.

        ``env``: environment variables each worker sets before it imports vLLM;
        ``cpu_threads``: each CPU engine's forward-pass threads (``vllm_cfg.cpu_threads``).

        Raises:
            BackendUnavailableError: the layout does not split into engines, an actor name is
                taken, or an engine failed or timed out; no actor is left running.
        """
        import ray

        groups = cluster.engine_groups(tensor_parallel_size)
        remote_cls: Any = ray.remote(VllmGenerationWorker)
        replicas = cls([], timeouts)
        replicas.launch = _Launch(
            remote_cls,
            cluster,
            groups,
            name_prefix,
            model,
            engine_args,
            engine_factory,
            dict(env or {}),
            cpu_threads,
        )
        try:
            for index in range(len(groups)):
                replicas.actors.append(replicas._new_actor(index, generation=0))
            logger.info("starting %d vLLM engine(s) for %s", len(groups), model)
            replicas.infos = replicas._wait(
                [a.info.remote() for a in replicas.actors], timeouts.startup_s, "start"
            )
        except BaseException as exc:
            replicas.shutdown()
            if isinstance(exc, BackendUnavailableError):
                raise
            if isinstance(exc, GenerationError):
                raise BackendUnavailableError(f"vLLM engines failed to start: {exc}") from exc
            raise
        logger.info(
            "vLLM engines ready in %s s",
            ", ".join(f"{i['startup_seconds']:.1f}" for i in replicas.infos),
        )
        return replicas

    def _new_actor(self, index: int, generation: int) -> Any:
        launch = self.launch
        assert launch is not None
        suffix = f"-r{generation}" if generation else ""
        return _start_actor(
            launch.remote_cls,
            launch.cluster,
            launch.groups[index],
            name_prefix=launch.name_prefix,
            name=f"{launch.name_prefix}-{index}-{id(launch.cluster):x}{suffix}",
            args=(launch.model, launch.engine_args),
            engine_factory=launch.engine_factory,
            env=launch.env,
            cpu_threads=launch.cpu_threads,
        )

    def start_replacement(
        self, replica: int, generation: int, started: Callable[[Any], None] | None = None
    ) -> tuple[Any, WorkerInfo]:
        """Start a new actor on ``replica``'s bundles (its engine group; Ray places it where the
        group's placement is) and wait until its engine is up. It is not a member yet: the
        caller loads and verifies its weights, then ``install``s it. ``generation``: how many
        replacements this slot had, for a fresh actor name. ``started`` receives the actor as
        soon as it exists (so a shutdown can kill it while it starts).

        Raises:
            GenerationError: the engine failed to start or did not within ``startup_s``; the
                actor is killed.
        """
        import ray

        actor = self._new_actor(replica, generation)
        if started is not None:
            started(actor)
        try:
            ref = actor.info.remote()
            ready, _ = ray.wait([ref], timeout=self.timeouts.startup_s)
            if not ready:
                raise WorkerLostError(
                    f"a replacement vLLM engine did not start within {self.timeouts.startup_s:g} "
                    "s (vllm_cfg.startup_timeout_s)"
                )
            try:
                info = ray.get(ref)
            except Exception as exc:
                raise translate_ray_error(exc, "start") from exc
        except BaseException:
            kill_actor(actor)
            raise
        return actor, info

    def install(self, replica: int, actor: Any, info: WorkerInfo) -> None:
        """``actor`` serves as ``replica`` from now on (the old one is dead)."""
        self.actors[replica] = actor
        self.infos[replica] = info

    def kill(self, replica: int) -> None:
        """Kill ``replica``'s actor now (it died, wedged or was evicted): never left half-alive."""
        if replica < len(self.actors):  # none left after shutdown
            kill_actor(self.actors[replica])

    def member_ids(self) -> list[int]:
        """The replicas that calls to "every replica" reach now, in order."""
        if self.pinned is not None:
            return list(self.pinned)
        return self.members() if self.members is not None else list(range(len(self.actors)))

    def _each(self) -> list[Any]:
        return [self.actors[i] for i in self.member_ids()]

    # ---- generation ------------------------------------------------------------------------

    def add_rows(self, replica: int, requests: list[RowRequest]) -> Any:
        """Add rows to ``replica``'s engine in one call; returns its Ray ``ObjectRef``."""
        return self.actors[replica].add_rows.remote(requests)

    def abort_rows(self, replica: int, request_ids: list[str]) -> Any:
        """Drop rows from ``replica``'s engine; returns the call's ``ObjectRef``."""
        return self.actors[replica].abort_rows.remote(request_ids)

    async def outputs(self, replica: int) -> AsyncIterator[bytes]:
        """``replica``'s stream of ``StepBatch``es, each in its wire form (``gen_vllm.wire``),
        until the worker shuts down. Open one per replica. A worker on this process's node
        sends it over a local socket (``gen_vllm.step_socket``), one on another node through
        a Ray streaming generator.

        Raises:
            WorkerLostError: the worker died (its socket closed without the stream's end).
            Ray's errors, as its calls raise them (``translate_ray_error``).
        """
        actor = self.actors[replica]
        if not (step_socket.supported() and self.infos[replica]["node_id"] == _this_node()):
            async for ref in actor.outputs.options(num_returns="streaming").remote():
                yield await ref
            return
        name, secret = await actor.open_step_socket.remote()
        try:
            async for message in step_socket.read_step_socket(name, secret):
                yield message
        except step_socket.StepSocketClosedError as exc:
            raise WorkerLostError(
                f"a vLLM worker died while rows ran on it ({exc}: its process exited or was "
                f"killed){_where_logged()}"
            ) from exc

    def rows_in_flight(self) -> list[int]:
        """How many rows each replica's engine holds now."""
        return self._wait(
            [a.rows_in_flight.remote() for a in self._each()],
            self.timeouts.control_s,
            "counting rows",
        )

    def score(
        self, shards: Sequence[tuple[list[list[int]], list[int]] | None], top_logprobs: int = 0
    ) -> list[Any]:
        """Score shard i on member i (skipped when None); per-member results, None if skipped."""
        members = self.member_ids()
        refs = {
            i: self.actors[i].score.remote(*shard, top_logprobs)
            for i, shard in zip(members, shards)
            if shard is not None
        }
        values = self._wait(list(refs.values()), self.timeouts.generate_s, "score")
        by_replica = dict(zip(refs, values))
        return [by_replica.get(i) for i in members]

    def score_outcomes(
        self, shards: Mapping[int, tuple[list[list[int]], list[int]]], top_logprobs: int = 0
    ) -> dict[int, Any]:
        """Score each shard on the replica it is keyed by; each one's result, or the
        ``GenerationError`` it ended with (a healing fleet re-runs those elsewhere)."""
        refs = [self.actors[i].score.remote(*shard, top_logprobs) for i, shard in shards.items()]
        return dict(zip(shards, self._outcomes(refs, self.timeouts.generate_s, "score")))

    # ---- life cycle and weights ------------------------------------------------------------

    def sleep(self, level: int) -> None:
        self._wait([a.sleep.remote(level) for a in self._each()], self.timeouts.control_s, "sleep")

    def wake_up(self, tags: list[str]) -> None:
        self._wait(
            [a.wake_up.remote(tags) for a in self._each()], self.timeouts.control_s, "wake_up"
        )

    def capture_routed_experts(self, native: bool = False) -> list[list[int] | str]:
        """Every replica returns its rows' MoE routing from now on (``native``: as vLLM's own
        option reads it): each one's ``[layers, top_k, experts]``, or why it cannot."""
        return self._wait(
            [a.capture_routed_experts.remote(native) for a in self._each()],
            self.timeouts.control_s,
            "capture_routed_experts",
        )

    def use_adapter(self, settings: dict[str, Any], adapter_path: str | None) -> None:
        """Every replica serves its rows with a LoRA adapter (``VllmGenerationWorker.
        use_adapter``)."""
        self._wait(
            [a.use_adapter.remote(settings, adapter_path) for a in self._each()],
            self.timeouts.control_s,
            "use_adapter",
        )

    def keep_committed_weights(self) -> int:
        """Every worker keeps a readable copy of the committed weights (``vllm_cfg.
        weight_deltas``); returns the bytes each rank holds."""
        sizes = self._wait(
            [a.keep_committed_weights.remote() for a in self._each()],
            self.timeouts.control_s,
            "keep_committed_weights",
        )
        return int(sizes[0]) if sizes else 0

    def weight_base(self) -> list[list[WeightBase | None]]:
        """Every replica's ranks' copies of the committed weights, described."""
        return self._wait(
            [a.weight_base.remote() for a in self._each()],
            self.timeouts.control_s,
            "weight_base",
        )

    def reset_prefix_cache(self) -> list[bool]:
        """Drop every replica's cached prefixes; each one's answer (False while rows hold
        blocks)."""
        return self._wait(
            [a.reset_prefix_cache.remote() for a in self._each()],
            self.timeouts.control_s,
            "reset_prefix_cache",
        )

    def start_weight_update(self, in_flight: InFlight) -> list[GenerationError | None]:
        """Open vLLM's weight-update transaction on every replica; each one's outcome.
        ``in_flight``: running rows pause (``"keep"``) or end now, cut short (``"abort"``)."""
        self.loads_sent = 0
        refs = [a.start_weight_update.remote(in_flight) for a in self._each()]
        return self._outcomes(refs, self.timeouts.update_s, "starting a weight update")

    def load_weights(self, info: LoadInfo) -> Callable[[], list[GenerationError | None]]:
        """Hand one load to every replica, which runs it after the loads handed over before it
        in this update; returns the wait for each replica's outcome (errors returned, not
        raised, so the caller can tell a load refused everywhere from replicas that now
        differ). Loads handed over together queue on the workers: none waits for a call."""
        order = self.loads_sent
        refs = [a.load_weights.remote(info, order) for a in self._each()]
        self.loads_sent += 1
        return lambda: self._outcomes(refs, self.timeouts.update_s, "a weight load")

    def finish_weight_update(self) -> list[list[UpdateReport] | GenerationError]:
        """Close the transaction on every replica (engines stay paused); each one's rank
        reports, or its error. A single replica skips the checksums only replicas compare."""
        members = self._each()
        compared = len(self.actors) > 1
        refs = [a.finish_weight_update.remote(compared) for a in members]
        return self._outcomes(refs, self.timeouts.update_s, "the end of a weight update")

    def end_weight_update(self, version: int | None, *, cut: bool) -> list[GenerationError | None]:
        """Resume every replica after an update: committed as ``version`` or dropped (None);
        ``cut`` ends the rows the update paused. Each replica's outcome."""
        refs = [a.end_weight_update.remote(version, cut) for a in self._each()]
        return self._outcomes(refs, self.timeouts.update_s, "resuming after a weight update")

    def init_collective(
        self,
        endpoint: CollectiveEndpoint,
        ranks_per_replica: int,
        replicas: Sequence[int] | None = None,
    ) -> None:
        """The workers of ``replicas`` (default: every member) join the weight group; the k-th
        one's ranks start at ``endpoint["rank_offset"] + k * ranks_per_replica``."""
        offset = endpoint["rank_offset"]
        ids = self.member_ids() if replicas is None else list(replicas)
        self._weight_group = {}
        refs = [
            self.actors[i].init_collective.remote(endpoint, offset + k * ranks_per_replica)
            for k, i in enumerate(ids)
        ]
        self._wait(refs, endpoint["timeout_s"], "joining the weight group")
        self._weight_group = {i: self.actors[i] for i in ids}

    def in_weight_group(self, replicas: Sequence[int]) -> bool:
        """Whether the last weight group formed holds exactly the workers of ``replicas``, each
        the worker that joined it (a replacement has not)."""
        group = self._weight_group
        return sorted(group) == sorted(replicas) and all(
            self.actors[i] is group[i] for i in replicas
        )

    def _outcomes(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        """Each ref's value, or the ``GenerationError`` it ended with (a ``WorkerLostError``
        for one still running after ``timeout_s``)."""
        import ray

        _, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        outcomes: list[Any] = []
        self.stuck = self.stuck or bool(late)
        for ref in refs:
            if ref in late:
                outcomes.append(
                    WorkerLostError(
                        f"a vLLM worker did not finish {what} within {timeout_s:g} s "
                        "(vllm_cfg.update_timeout_s)"
                    )
                )
                continue
            try:
                outcomes.append(ray.get(ref))
            except Exception as exc:
                outcomes.append(translate_ray_error(exc, what))
        return outcomes

    def shutdown(self) -> None:
        """Stop every engine, then kill every actor, so no process is left behind. Idempotent.
        After a call timed out (``stuck``), the actors are killed without waiting. When Ray's
        GCS is gone (a signal reached every process of the service), nothing is asked of Ray:
        the workers went with it, and each call would wait a minute for the GCS."""
        import ray

        if not self.actors:
            return
        if not ray_reachable():
            logger.warning("Ray's GCS is gone: the vLLM workers are left to it")
            self.actors = []
            return
        if not self.stuck:
            stops = [actor.shutdown.remote() for actor in self._each()]
            ray.wait(stops, num_returns=len(stops), timeout=_SHUTDOWN_GRACE_S)
        for actor in self.actors:
            kill_actor(actor)
        self.actors = []

    def _wait(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        """Wait for every ref, logging progress on long waits; translate Ray's errors.

        Raises:
            WorkerLostError: a worker died, or the wait passed ``timeout_s``.
            GenerationError (or the worker's own subclass of it): a worker raised.
        """
        import ray

        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            wait_s = min(_PROGRESS_EVERY_S, max(0.0, deadline - time.monotonic()))
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
            if pending and time.monotonic() >= deadline:
                self.stuck = True
                raise WorkerLostError(
                    f"vLLM workers did not finish {what} within {timeout_s:g} s "
                    f"({len(pending)} of {len(refs)} still running; vllm_cfg.*_timeout_s set "
                    "the limits)"
                )
            if pending:
                logger.info(
                    "waiting for %s: %d of %d replicas done",
                    what,
                    len(refs) - len(pending),
                    len(refs),
                )
        try:
            return ray.get(refs)
        except Exception as exc:
            raise translate_ray_error(exc, what) from exc


def kill_actor(actor: Any) -> None:
    """Kill ``actor``'s process at once (Ray SIGKILLs it, stopped or not); quiet when it is
    dead already."""
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # already dead
        logger.debug("kill: %s", exc)


def translate_ray_error(exc: BaseException, what: str) -> GenerationError:
    """The interface's error for a Ray failure: the worker's own ``GenerationError`` when it
    raised one, else a ``GenerationError`` saying the worker failed or died."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if isinstance(exc.cause, BaseException) else None
        if isinstance(cause, GenerationError):
            return cause
        return GenerationError(f"a vLLM worker failed during {what}: {cause or exc}")
    if isinstance(exc, ray.exceptions.RayActorError):
        return WorkerLostError(
            f"a vLLM worker died during {what} (its process exited or was killed): "
            f"{_summary(exc)}{_where_logged()}"
        )
    if isinstance(exc, GenerationError):
        return exc
    return GenerationError(f"a vLLM worker call failed during {what}: {exc!r}")


def _start_actor(
    remote_cls: Any,
    cluster: RayVirtualCluster,
    group: list[Bundle],
    *,
    name_prefix: str,
    name: str,
    args: tuple[str, dict[str, Any]],
    engine_factory: EngineFactory | None,
    env: Mapping[str, str],
    cpu_threads: int | None = None,
) -> Any:
    """Create one worker actor in the first bundle of ``group`` (its engine's bundles)."""
    bundle = group[0]
    env = {**env, **worker_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if cluster.use_gpus and len(group) > 1:
        env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(b.bundle_index) for b in group)
    try:
        return remote_cls.options(
            name=name,
            num_cpus=bundle.num_cpus,
            num_gpus=_gpus_for(cluster, bundle, len(group)),
            scheduling_strategy=cluster.scheduling_strategy(
                bundle, capture_child_tasks=len(group) > 1
            ),
            max_restarts=0,
            max_concurrency=_MAX_ROWS_IN_FLIGHT,
            # No runtime_env: the worker sets ``env`` itself before it imports vLLM, so Ray can
            # hand the actor a worker process it already started (about 5 s less per engine
            # than a process started for a runtime_env of its own).
        ).remote(*args, _cpu_ids_for(cluster, bundle), env, engine_factory, cpu_threads)
    except ValueError as exc:  # Ray refuses before creating anything
        clash = "already exists" in str(exc) or "already taken" in str(exc)
        raise BackendUnavailableError(
            f"cannot start vLLM worker {name!r}: {exc}."
            + (
                f" Another VllmGeneration with name_prefix={name_prefix!r} runs on this cluster; "
                "give this one another name_prefix"
                if clash
                else ""
            )
        ) from exc


#: Requests one worker serves at once: rows queue in its engine, which batches them.
_MAX_ROWS_IN_FLIGHT = 4096


def _this_node() -> str:
    """The Ray node this process runs on ("" without Ray), as ``WorkerInfo.node_id``."""
    import ray

    return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else ""


def _where_logged() -> str:
    """Where the workers' own output is, for an error about one that died."""
    return "" if verbose() else f"; the engines' output is in {log_file()}"


def _summary(exc: BaseException) -> str:
    """The first line of a Ray error and, when it carries a traceback, the error at its end."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else type(exc).__name__
    return f"{lines[0]} ... {lines[-1]}"


def _gpus_for(cluster: RayVirtualCluster, bundle: Bundle, engine_size: int) -> float:
    if not cluster.use_gpus or engine_size > 1:
        return 0.0  # with TP > 1, vLLM's own Ray workers take the GPUs of the bundles
    return bundle.num_gpus / cluster.max_colocated_worker_groups


def _cpu_ids_for(cluster: RayVirtualCluster, bundle: Bundle) -> tuple[int, int] | None:
    """``(slot, slots)``: the actor takes the slot-th share of its node's cores (CPU engines)."""
    return None if cluster.use_gpus else (bundle.local_index, bundle.local_count)
