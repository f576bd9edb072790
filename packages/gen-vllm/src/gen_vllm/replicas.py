"""``ReplicaSet``: the Ray actors of one ``VllmGeneration`` and how calls reach them.

Every call goes to all replicas concurrently and waits on all of them, so a dead worker is
noticed as soon as Ray notices (seconds), and Ray's errors become the interface's errors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gen_interface import BackendUnavailableError, GenerationError

from gen_vllm.cluster import Bundle, RayVirtualCluster
from gen_vllm.worker import VllmGenerationWorker

__all__ = ["ReplicaSet"]

logger = logging.getLogger(__name__)

_PROGRESS_EVERY_S = 15.0
_SHUTDOWN_GRACE_S = 30.0


@dataclass
class ReplicaSet:
    """Handles of the running ``VllmGenerationWorker`` actors, in replica order."""

    actors: list[Any]
    infos: list[dict[str, Any]] = field(default_factory=list)

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
        startup_timeout_s: float,
    ) -> ReplicaSet:
        """Start one actor per group of ``tensor_parallel_size`` bundles and wait until every
        engine is up, logging progress.

        Raises:
            BackendUnavailableError: an engine failed or timed out; all actors are stopped.
        """
        import ray

        remote_cls: Any = ray.remote(VllmGenerationWorker)
        actors = []
        for index, first in enumerate(range(0, cluster.world_size, tensor_parallel_size)):
            bundle = cluster.bundles[first]
            env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            if cluster.use_gpus and tensor_parallel_size > 1:
                bundles = range(first, first + tensor_parallel_size)
                env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(
                    str(cluster.bundles[b].bundle_index) for b in bundles
                )
            actors.append(
                remote_cls.options(
                    name=f"{name_prefix}-{index}-{id(cluster):x}",
                    num_cpus=bundle.num_cpus,
                    num_gpus=_gpus_for(cluster, bundle, tensor_parallel_size),
                    scheduling_strategy=cluster.scheduling_strategy(
                        bundle, capture_child_tasks=tensor_parallel_size > 1
                    ),
                    max_restarts=0,
                    runtime_env={"env_vars": env},
                ).remote(model, engine_args, _cpu_ids_for(cluster, bundle), env)
            )
        replicas = cls(actors)
        logger.info("starting %d vLLM engine(s) for %s", len(actors), model)
        try:
            replicas.infos = replicas._wait(
                [a.info.remote() for a in actors], startup_timeout_s, "start"
            )
        except GenerationError as exc:
            replicas.shutdown()
            raise BackendUnavailableError(f"vLLM engines failed to start: {exc}") from exc
        logger.info(
            "vLLM engines ready in %s s",
            ", ".join(f"{i['startup_seconds']:.1f}" for i in replicas.infos),
        )
        return replicas

    def call_each(
        self, method: str, args: Sequence[tuple[Any, ...] | None], timeout_s: float | None = None
    ) -> list[Any]:
        """Call ``method`` on replica i with ``args[i]`` (skipped when None), concurrently."""
        refs = {
            i: getattr(actor, method).remote(*a)
            for i, (actor, a) in enumerate(zip(self.actors, args))
            if a is not None
        }
        values = self._wait(list(refs.values()), timeout_s, method)
        by_replica = dict(zip(refs, values))
        return [by_replica.get(i) for i in range(len(self.actors))]

    def call_all(
        self, method: str, args: tuple[Any, ...], timeout_s: float | None = None
    ) -> list[Any]:
        """Call ``method`` with the same ``args`` on every replica, concurrently."""
        return self.call_each(method, [args] * len(self.actors), timeout_s)

    def _wait(self, refs: list[Any], timeout_s: float | None, what: str) -> list[Any]:
        """Wait for every ref, logging progress on long waits; translate Ray's errors.

        Raises:
            GenerationError (or the worker's own ``GenerationError`` subclass): a worker died,
                raised, or the wait passed ``timeout_s``.
        """
        import ray

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            wait_s = _PROGRESS_EVERY_S
            if deadline is not None:
                wait_s = min(wait_s, max(0.0, deadline - time.monotonic()))
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
            if pending and deadline is not None and time.monotonic() >= deadline:
                raise GenerationError(
                    f"vLLM workers did not finish {what} within {timeout_s:g} s "
                    f"({len(pending)} of {len(refs)} still running)"
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
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else None
            if isinstance(cause, GenerationError):
                raise cause from None
            raise GenerationError(f"a vLLM worker failed during {what}: {cause or exc}") from exc
        except ray.exceptions.RayActorError as exc:
            raise GenerationError(
                f"a vLLM worker died during {what} (its process exited or was killed): "
                f"{_summary(exc)}"
            ) from exc

    def shutdown(self) -> None:
        """Stop every engine, then kill every actor, so no process is left behind. Idempotent."""
        import ray

        if not self.actors:
            return
        stops = [actor.shutdown.remote() for actor in self.actors]
        ray.wait(stops, num_returns=len(stops), timeout=_SHUTDOWN_GRACE_S)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already dead
                logger.debug("kill: %s", exc)
        self.actors = []


def _summary(exc: BaseException) -> str:
    """The first line of a Ray error and, when it carries a traceback, the error at its end."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else type(exc).__name__
    return f"{lines[0]} ... {lines[-1]}"


def _gpus_for(cluster: RayVirtualCluster, bundle: Bundle, tensor_parallel_size: int) -> float:
    if not cluster.use_gpus or tensor_parallel_size > 1:
        return 0.0  # with TP > 1, vLLM's own Ray workers take the GPUs of the bundles
    return bundle.num_gpus / cluster.max_colocated_worker_groups


def _cpu_ids_for(cluster: RayVirtualCluster, bundle: Bundle) -> tuple[int, int] | None:
    """``(slot, slots)``: the actor takes the slot-th share of its node's cores (CPU engines)."""
    return None if cluster.use_gpus else (bundle.local_index, bundle.local_count)
