"""``VllmGenerationWorker``: one vLLM engine in its own process, run as an async Ray actor.

Everything crossing the actor boundary is plain data (``messages.py``): token-id lists, dicts of
sampling settings, weight handles. The engine runs in the actor's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on the thread of an ``EngineLoop``. Rows arrive in batches
(``add_rows``) and leave through one stream per worker (``outputs``): one message per engine
step for every row, pushed as the step ends; control calls (weights, sleep, scoring) are plain
actor calls answered by the actor's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from gen_backend_kit.weights import release_shared_weights
from gen_backend_kit.weights.relay import bucket_bytes, rehosted_bucket, rehosted_handles
from gen_interface import BackendUnavailableError, InFlight
from gen_interface.weights import WeightBase
from gen_interface.weights.collective import CollectiveEndpoint
from gen_interface.weights.handles import WeightBucket, WeightHandles

from gen_vllm import wire
from gen_vllm.adapter import ADAPTER_ID, ADAPTER_NAME
from gen_vllm.engine import EngineFactory, EngineProtocol, VllmEngine
from gen_vllm.engine_loop import EngineLoop
from gen_vllm.load_order import LoadOrder
from gen_vllm.logs import redirect_worker_output
from gen_vllm.messages import (
    RowRequest,
    ScoredTokens,
    UpdateReport,
    WorkerInfo,
)
from gen_vllm.receive import LoadInfo
from gen_vllm.step_socket import StepSocketServer

__all__ = ["VllmGenerationWorker"]

#: ``SamplingParams`` of a scoring request: one greedy token, the prompt's logprobs.
_SCORE_PARAMS = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "detokenize": False}


logger = logging.getLogger(__name__)


class VllmGenerationWorker:
    """Owns one vLLM engine. Built by ``VllmGeneration``, one per data-parallel replica.

    Args:
        model: model directory or hub name.
        engine_args: keyword arguments for ``vllm.EngineArgs``.
        cpu_slot: ``(slot, slots)``: take the slot-th of ``slots`` equal shares of this
            machine's cores (CPU engines sharing a machine), or None to leave affinity alone.
        cpu_threads: threads of the engine's forward pass on its share; None: the share's
            cores but one (at least one), the one left for this process's scheduling and
            messages, as vLLM's own server leaves one for its scheduler.
        env: environment variables to set before vLLM is imported.
        engine_factory: builds the engine; default ``VllmEngine`` (tests pass a fake).
    """

    def __init__(
        self,
        model: str,
        engine_args: dict[str, Any],
        cpu_slot: tuple[int, int] | None = None,
        env: dict[str, str] | None = None,
        engine_factory: EngineFactory | None = None,
        cpu_threads: int | None = None,
    ):
        os.environ.update(env or {})
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        redirect_worker_output()  # vLLM's output to the log file unless GEN_VERBOSE
        _allow_amx()
        _undo_worker_niceness()
        cpu_ids = _cores_for(cpu_slot) if cpu_slot else None
        self._wide_threads: int | None = None
        threads = None
        if cpu_ids:
            threads = engine_threads(len(cpu_ids), cpu_threads)
            if cpu_threads is None:
                self._wide_threads = len(cpu_ids)
            os.sched_setaffinity(0, cpu_ids)
            os.environ["OMP_NUM_THREADS"] = str(threads)
        self._updating = False  # vLLM's weight-update transaction is open
        self._keeps_copy = False  # updates are staged in a copy of the weights (weight_deltas)
        self._load_order = LoadOrder()
        self._adapter: tuple[dict[str, Any], str] | None = None  # (lora settings, its directory)
        self._info: WorkerInfo | None = None  # set once the engine is up
        self._step_socket: StepSocketServer | None = None  # opened by the driver's first read
        self._start_error = ""
        try:
            self._start(model, engine_args, threads, engine_factory or VllmEngine)
        except Exception as exc:  # reported by info(), whole: Ray would cut a dead actor's
            logger.exception("the vLLM engine failed to start")
            self._start_error = f"{type(exc).__name__}: {exc}"

    def _start(
        self,
        model: str,
        engine_args: dict[str, Any],
        threads: int | None,
        factory: EngineFactory,
    ) -> None:
        start = time.perf_counter()
        self._loop = EngineLoop(
            lambda: factory(model, engine_args),
            num_threads=threads,
            wide_threads=self._wide_threads,
        )
        engine: EngineProtocol = self._loop.engine
        specs, optional = self._loop.run(lambda: engine.collective_rpc("checkpoint_specs")[0])
        drafter, drafter_optional = self._loop.run(
            lambda: engine.collective_rpc("drafter_specs")[0]
        )
        self._info = WorkerInfo(
            pid=os.getpid(),
            host=socket.gethostname(),
            node_id=_ray_node_id(),
            device_ids=self._loop.run(lambda: engine.collective_rpc("report_device_id")),
            vocab_size=engine.limits.vocab_size,
            max_model_len=engine.limits.max_model_len,
            dtype=engine.limits.dtype,
            startup_seconds=time.perf_counter() - start,
            checkpoint_specs=specs,
            optional_weights=list(optional),
            drafter_specs=drafter,
            drafter_optional=list(drafter_optional),
        )

    async def info(self) -> WorkerInfo:
        """Where this replica runs and what its engine can take.

        Raises:
            BackendUnavailableError: the engine failed to start; the message holds vLLM's
                whole error.
        """
        if self._info is None:
            raise BackendUnavailableError(
                f"the vLLM engine of {socket.gethostname()} (pid {os.getpid()}) failed to "
                f"start: {self._start_error}"
            )
        return self._info

    async def capture_routed_experts(self, native: bool = False) -> list[int] | str:
        """Return every row's MoE routing from now on (``native``: vLLM's own option reads
        it): ``[layers, top_k, experts]``, or why this engine cannot."""
        return await self._loop.call(lambda: self._loop.capture_routing(native))

    async def use_adapter(self, settings: dict[str, Any], adapter_path: str | None) -> None:
        """Serve every row with a LoRA adapter: the PEFT directory ``adapter_path``, or a zero
        adapter of ``settings`` (rank, alpha, target modules) written here."""

        def use() -> None:
            self._adapter = (dict(settings), tempfile.mkdtemp(prefix="gen-lora-"))
            path = adapter_path
            if path is None:
                path = os.path.join(self._adapter[1], "v0")
                self._loop.engine.collective_rpc("write_adapter", (path, settings, True))
            self._loop.adapter = {
                "lora_name": ADAPTER_NAME,
                "lora_int_id": ADAPTER_ID,
                "lora_path": path,
            }

        await self._loop.call(use)

    def _serve_new_adapter(self, version: int) -> None:
        """After a commit: the adapter the update carried, if any, replaces the served one."""
        if self._adapter is None or self._loop.adapter is None:
            return
        settings, root = self._adapter
        path = os.path.join(root, f"v{version}")
        if not self._loop.engine.collective_rpc("write_adapter", (path, settings, False))[0]:
            return
        old = self._loop.adapter["lora_path"]
        self._loop.adapter = {**self._loop.adapter, "lora_path": path}
        self._loop.engine.add_lora({**self._loop.adapter, "load_inplace": True})
        if old.startswith(root):
            shutil.rmtree(old, ignore_errors=True)

    async def rows_in_flight(self) -> int:
        """Rows this replica's engine holds now (running, queued or paused)."""
        return self._loop.in_flight

    async def add_rows(self, requests: list[RowRequest]) -> None:
        """Add rows to the engine, all in one command between two steps; their results come
        through ``outputs``.

        Raises:
            EngineFailedError: the engine failed earlier; none was added.
        """
        await self._loop.add_rows(requests)

    async def abort_rows(self, request_ids: list[str]) -> None:
        """Drop rows the driver gave up on; they report nothing more."""
        self._loop.abort_rows(request_ids)

    async def outputs(self) -> AsyncIterator[bytes]:
        """What the engine produces, pushed as it comes: one ``StepBatch`` per engine step
        (several steps' worth when the reader falls behind) with the new tokens of the rows
        that stream and every row that ended, each as one message (``gen_vllm.wire``). Called
        once, by the driver, as a Ray streaming generator; ends when the engine shuts down."""
        while (batch := await self._loop.feed.take()) is not None:
            yield wire.encode(batch)

    async def open_step_socket(self) -> tuple[str, bytes]:
        """The same stream as ``outputs``, served on a local socket for a driver on this node
        (``gen_vllm.step_socket``): the socket's name and the secret a reader sends first."""
        if self._step_socket is None:
            self._step_socket = StepSocketServer(self._loop.feed)
        return await self._step_socket.open()

    async def score(
        self, sequences: list[list[int]], prompt_lengths: list[int], top_logprobs: int = 0
    ) -> list[ScoredTokens]:
        """Teacher-forced raw logprobs of each sequence's tokens after its prompt, and the
        ``top_logprobs`` likeliest tokens at each of those positions."""
        call = uuid.uuid4().hex[:8]
        params = {**_SCORE_PARAMS, "prompt_logprobs": top_logprobs}
        outputs = await asyncio.gather(
            *(
                self._loop.generate(RowRequest(f"score-{call}-{i}", sequence, params))
                for i, sequence in enumerate(sequences)
            )
        )
        return [
            ScoredTokens(
                logprobs=(out.prompt_logprobs or [])[start - 1 :],
                topk_ids=(out.prompt_topk_ids or [])[start - 1 :],
                topk_logprobs=(out.prompt_topk_logprobs or [])[start - 1 :],
                routed_experts=out.routed_experts,
            )
            for out, start in zip(outputs, prompt_lengths)
        ]

    # ---- weight updates: vLLM's transaction, with this project's transfer engine -------------

    async def start_weight_update(self, in_flight: InFlight = "keep") -> None:
        """Stop stepping and open vLLM's transaction. Running rows keep their place and wait
        for ``end_weight_update`` (``"keep"``), or end now with their tokens so far
        (``"abort"``)."""

        def start() -> None:
            if in_flight == "abort":
                cut = self._loop.cut_all()
                if cut:
                    logger.info("a weight update cut %d running rows short", cut)
            self._loop.pause()
            try:
                self._loop.engine.collective_rpc("start_weight_update")
            except BaseException:
                self._loop.resume()
                raise
            self._updating = True

        await self._load_order.new_update()
        await self._loop.call(start)

    async def load_weights(self, info: LoadInfo, order: int) -> None:
        """One load (shared buckets or a broadcast bucket) into every rank of this engine,
        queued after the loads before it in this update (``order``: see ``load_order.py``)."""
        async with self._load_order.turn(order):
            queued = self._loop.submit(
                lambda: self._loop.engine.collective_rpc("update_weights", (info,))
            )
        await asyncio.wrap_future(queued)

    async def finish_weight_update(self, compared: bool = True) -> list[UpdateReport]:
        """Close vLLM's transaction and return each rank's report. The engine stays paused
        until ``end_weight_update``: the driver checks the reports of every replica first.
        ``compared``: other replicas' reports are compared with these (see
        ``weight_update_report``)."""

        def finish() -> list[UpdateReport]:
            engine = self._loop.engine
            self._updating = False
            engine.collective_rpc("finish_weight_update")
            return engine.collective_rpc("weight_update_report", (compared,))

        return await self._loop.call(finish)

    async def end_weight_update(self, version: int | None, cut: bool) -> None:
        """Resume after an update: committed as ``version``, or dropped (None). ``cut``: end
        the rows the update paused, with their tokens so far (it wrote weights that are now
        part old, part new). vLLM's transaction is closed first if it is still open; an update
        staged in the copy of the committed weights (``weight_deltas``) is undone there first
        (the engine never saw it). At a commit the drafter model takes the drafter tensors the
        update carried (kept aside until now, so a dropped update never reaches it)."""

        def end() -> None:
            engine = self._loop.engine
            try:
                if version is None and self._keeps_copy:
                    engine.collective_rpc("drop_staged_weights")
                if self._updating:  # dropped before finish_weight_update
                    self._updating = False
                    engine.collective_rpc("finish_weight_update")
                if version is not None:
                    if self._keeps_copy:
                        engine.collective_rpc("commit_staged_weights", (version,))
                    engine.collective_rpc("load_drafter_update")
                    self._loop.set_version(version)
                    self._serve_new_adapter(version)
                else:
                    engine.collective_rpc("drop_drafter_update")
                if version is not None or cut:
                    engine.reset_prefix_cache()  # KV computed with other weights
            finally:
                if cut:
                    cut_rows = self._loop.cut_all()
                    if cut_rows:
                        logger.info("a dropped weight update cut %d paused rows short", cut_rows)
                self._loop.resume()

        await self._loop.call(end)

    async def keep_committed_weights(self) -> int:
        """Every rank keeps a readable copy of the committed weights from the next update on,
        and stages updates in it (``vllm_cfg.weight_deltas``); returns its bytes per rank."""

        def keep() -> int:
            sizes = self._loop.engine.collective_rpc("keep_committed_weights")
            self._keeps_copy = True
            return int(sizes[0])

        return await self._loop.call(keep)

    async def weight_base(self) -> list[WeightBase | None]:
        """Each rank's copy of the committed weights, described (None: it keeps none)."""
        return await self._loop.call(
            lambda: self._loop.engine.collective_rpc("committed_weights_base")
        )

    async def share_committed_weights(self) -> tuple[int | None, dict[str, Any]] | None:
        """The copy of the committed weights (``weight_deltas``) in shared buckets, with its
        version, for a replacement replica; None without a copy. Freed by
        ``release_committed_weights`` (or by the reader, bucket by bucket)."""
        shared = await self._loop.call(
            lambda: self._loop.engine.collective_rpc("share_committed_weights")
        )
        return shared[0] if shared else None

    async def release_committed_weights(self) -> None:
        await self._loop.call(lambda: self._loop.engine.collective_rpc("release_committed_weights"))

    async def shared_bucket(self, handles: dict[str, Any], index: int) -> np.ndarray:
        """Bucket ``index`` of weights shared on this node (``share_committed_weights``), its
        bytes copied out for another node (``relay.bucket_bytes``); off the actor's loop."""
        return await asyncio.to_thread(bucket_bytes, handles, index)

    async def relay_shared_weights(self, peer: Any, handles: dict[str, Any]) -> WeightHandles:
        """Bring weights shared on another node (``peer``'s actor) to this one, a bucket at a
        time through Ray's object store, into shared memory here: handles for ``load_weights``
        that keep every checksum of the producer's (the load verifies each tensor). Release
        them with ``release_relayed_weights`` once loaded, or on failure.

        Raises:
            WeightUpdateError: a bucket arrived with the wrong size, or this node's shared
                memory has no room; nothing relayed is left behind.
        """
        buckets: list[WeightBucket] = []
        try:
            for index, bucket in enumerate(handles["buckets"]):
                data = await peer.shared_bucket.remote(handles, index)
                buckets.append(await asyncio.to_thread(rehosted_bucket, bucket, data))
                del data  # one bucket in transit at a time
        except BaseException:
            release_shared_weights(rehosted_handles(buckets))
            raise
        return rehosted_handles(buckets)

    async def release_relayed_weights(self, handles: dict[str, Any]) -> int:
        """Remove the segments ``relay_shared_weights`` made (idempotent); how many."""
        return release_shared_weights(handles)

    async def weight_report(self) -> list[UpdateReport]:
        """Each rank's checksums of the weights it serves now (``weight_update_report``, as
        compared between replicas), computed between engine steps: what a replacement's
        weights must equal before it is admitted."""
        return await self._loop.call(
            lambda: self._loop.engine.collective_rpc("weight_update_report", (True,))
        )

    async def init_collective(self, endpoint: CollectiveEndpoint, rank: int) -> None:
        """Join the trainer's weight group: this engine's tensor-parallel rank r as ``rank + r``."""
        init_info = {"endpoint": dict(endpoint), "rank": rank}
        await self._loop.call(
            lambda: self._loop.engine.collective_rpc("init_weight_transfer_engine", (init_info,))
        )

    async def reset_prefix_cache(self) -> bool:
        return await self._loop.call(self._loop.engine.reset_prefix_cache)

    async def sleep(self, level: int) -> None:
        await self._loop.call(lambda: self._loop.engine.sleep(level))

    async def wake_up(self, tags: list[str]) -> None:
        await self._loop.call(lambda: self._loop.engine.wake_up(tags))

    async def shutdown(self) -> None:
        """Stop the engine and free its memory; the actor is killed afterwards."""
        if self._info is not None:
            await asyncio.to_thread(self._loop.close)
        if self._step_socket is not None:
            self._step_socket.close()
        if self._adapter is not None:
            shutil.rmtree(self._adapter[1], ignore_errors=True)


def engine_threads(cores: int, asked: int | None) -> int:
    """The forward pass's threads on a share of ``cores``: ``asked`` (``vllm_cfg.cpu_threads``),
    else every core but one, which is left to this process's scheduling and Ray's messages.

    A thread of the forward pass that shares its core is stalled whenever the core runs anything
    else, and the others wait for it at every parallel operation: on two cores, two threads
    spent twice the CPU time of one for the same steps and slowed serving to half of vLLM's
    (whose server also leaves a core to its scheduler). A share of one core keeps one thread.

    Unless ``asked``, a step takes every core of the share while many rows run and none streams
    (``EngineLoop``'s ``wide_threads``): then nothing on the token path runs until a row ends.
    """
    return asked or max(1, cores - 1)


def _cores_for(slot: tuple[int, int]) -> list[int]:
    """The slot-th of ``slots`` equal, disjoint shares of the cores this process may use."""
    index, count = slot
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // count)
    chosen = cores[index * share : (index + 1) * share]
    return chosen or [cores[index % len(cores)]]


def _allow_amx() -> None:
    """Ask Linux for permission to use AMX tile registers in this process.

    vLLM's CPU attention kernels use AMX for bfloat16 on CPUs that report it, but never ask the
    kernel for the AMX state; where nothing else in the process has asked, the first bfloat16
    attention call dies with SIGILL. Asking is harmless where AMX is absent.
    """
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return
    arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    with contextlib.suppress(OSError):
        ctypes.CDLL(None, use_errno=True).syscall(arch_prctl, req_xcomp_perm, xfeature_xtiledata)


def _undo_worker_niceness() -> None:
    """Run at normal priority where allowed.

    Ray starts workers at niceness 15, fit for background tasks; an engine at that priority loses
    5-10% of its throughput to any other process on its cores (measured on 2 cores). Lowering
    niceness needs privilege, so this is best effort; ``RayVirtualCluster`` also starts its own
    Ray with ``RAY_worker_niceness=0``.
    """
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 0)


def _ray_node_id() -> str:
    """The Ray node this process runs on; "" outside a Ray worker (a test's direct call)."""
    import ray

    return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else ""
