"""``VllmGeneration``: many vLLM engines behind one ``generate`` call.

``GenerationBackend`` holds what every backend shares (validation, per-row sampling, the life
cycle, the weight-update transaction); this class is the steps that reach the engines: rows to
replicas, scores, sleep and wake, and the workers' side of an update (``update_steps.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, ClassVar, cast

import torch
from gen_backend_kit import GenerationBackend, GenerationCall, RowResult
from gen_backend_kit.fleet_health import FleetHealth
from gen_backend_kit.lifecycle import DUMMY_WEIGHTS, Resource, close_all
from gen_backend_kit.lora import adapter_specs, lora_settings
from gen_backend_kit.scoring import ScoreBatch, ScoredRow
from gen_backend_kit.speculation import DEFAULT_MIN_ACCEPTANCE_RATE
from gen_backend_kit.stepping import RowControl
from gen_backend_kit.text import HfTokenizerCodec, TextCodec
from gen_backend_kit.weights.consumer import TensorSpecs
from gen_backend_kit.weights.updates import LoadWait
from gen_interface import (
    BackendCapabilities,
    BackendUnavailableError,
    BatchedDataDict,
    GenerationConfig,
    GenerationConfigError,
    GenerationError,
    GenerationInputError,
    InFlight,
    NoReplicaServingError,
    RowEvent,
)
from gen_interface.schema import ForeignKeys
from gen_interface.weights.collective import BroadcastBucket, CollectiveEndpoint
from gen_interface.weights.handles import WeightBase, WeightHandles, describe_weight_handles

from gen_vllm.background_loop import BackgroundLoop
from gen_vllm.cluster import RayVirtualCluster
from gen_vllm.config import (
    SPECULATIVE_METHODS,
    VLLM_FOREIGN_KEYS,
    VllmConfig,
    complete_vllm_config,
)
from gen_vllm.delivery import DeliveryTimes
from gen_vllm.drafter import is_drafter_weight
from gen_vllm.engine import EngineFactory
from gen_vllm.engine_args import engine_args_for, engine_env, routing_mode
from gen_vllm.fleet import Fleet
from gen_vllm.messages import RowOutput, RowRequest, ScoredTokens, TokenDelta
from gen_vllm.params import row_sampling_params
from gen_vllm.receive import LoadInfo
from gen_vllm.replicas import ReplicaSet, Timeouts, WorkerLostError
from gen_vllm.router import RowItem, RowRouter
from gen_vllm.routing import read_routing
from gen_vllm.update_steps import ReplicaUpdateSteps

__all__ = ["VllmGeneration"]


class VllmGeneration(GenerationBackend):
    """vLLM engines as Ray actors, one per data-parallel replica.

    ``replicas = cluster bundles / tensor_parallel_size``; an engine's bundles are always on one
    node. ``generate`` validates the batch and sends each row to the replica with the least
    outstanding work; rows come back as they finish and are laid out in input order. Row seeds
    come from the config seed and the row's index in the whole batch, so a row's sample does not
    depend on which replica runs it.

    Args:
        cluster: the resources to run on.
        config: a configured ``VllmConfig`` (``configure_generation_config`` first).
        name_prefix: prefix for the actors' names.
        engine_factory: builds each worker's engine; default vLLM's (tests pass a fake).

    Raises:
        GenerationConfigError: a config field is out of range.
        BackendUnavailableError: the cluster's layout does not fit the config, or an engine
            failed to start (its error is in the message).
    """

    config: VllmConfig
    config_schema: ClassVar[type] = VllmConfig
    config_foreign_keys: ClassVar[ForeignKeys] = VLLM_FOREIGN_KEYS
    settings_key: ClassVar[str | None] = "vllm_cfg"
    speculative_methods: ClassVar[frozenset[str]] = SPECULATIVE_METHODS

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: VllmConfig,
        name_prefix: str = "vllm",
        *,
        engine_factory: EngineFactory | None = None,
    ):
        config = self.complete_config(config)
        self.cluster = cluster
        self._owned_cluster: RayVirtualCluster | None = None
        cfg = config["vllm_cfg"]
        tp = cfg["tensor_parallel_size"]
        if tp > 1 and not cluster.use_gpus:
            raise BackendUnavailableError(
                "tensor_parallel_size > 1 needs GPUs; on CPU run more replicas instead"
            )
        if config.get("batch_invariant", False) and not cluster.use_gpus:
            raise BackendUnavailableError(
                "batch_invariant is true but vLLM's batch-invariant mode needs CUDA: on its "
                "CPU build VLLM_BATCH_INVARIANT overrides no kernel (they need Triton). Use "
                "backend 'hf' for batch-invariant rollouts on the CPU"
            )
        cluster.engine_groups(tp)  # refuses layouts where an engine would span nodes
        engine_args = engine_args_for(config, use_gpus=cluster.use_gpus)
        self._sleeps = bool(engine_args["enable_sleep_mode"])
        healing = bool(cfg["healing"])
        # healing: a replica's part of a refit is bounded by the refit deadline, then evicted
        update_s = min(cfg["update_timeout_s"], cfg["refit_deadline_s"]) if healing else None
        self.replicas = ReplicaSet.start(
            cluster,
            config["model_name"],
            engine_args,
            tensor_parallel_size=tp,
            name_prefix=name_prefix,
            timeouts=Timeouts(
                startup_s=cfg["startup_timeout_s"],
                generate_s=cfg["generate_timeout_s"],
                update_s=update_s or cfg["update_timeout_s"],
                control_s=cfg["control_timeout_s"],
            ),
            engine_factory=engine_factory,
            env=engine_env(config, use_gpus=cluster.use_gpus),
            cpu_threads=cfg["cpu_threads"],
        )
        mode = routing_mode(config, use_gpus=cluster.use_gpus)
        self._routing = self._capture_routing(config, mode == "native") if mode else None
        first = self.replicas.infos[0]
        checkpoint = {
            name: (torch.Size(shape), getattr(torch, dtype))
            for name, (shape, dtype) in first["checkpoint_specs"].items()
        }
        adapter = self._serve_adapter(config, checkpoint) if config.get("lora") else {}
        # the drafter model's tensors ("drafter." names): a refit group of their own, staged
        # until the commit (config refuses them with lora or weight_deltas)
        drafter = {
            name: (torch.Size(shape), getattr(torch, dtype))
            for name, (shape, dtype) in first["drafter_specs"].items()
        }
        optional = [*first["optional_weights"], *first["drafter_optional"]]
        #: The version of the last committed update that carried the drafter's weights.
        self.drafter_version = 0
        self._has_drafter = bool(drafter)
        self._update_carries_drafter = False
        #: Bytes of each rank's copy of the committed weights (``weight_deltas``; 0: none).
        self.committed_copy_bytes = (
            self.replicas.keep_committed_weights() if cfg["weight_deltas"] else 0
        )
        # with the copy, every update is staged in it until the commit (staging.py)
        staged = checkpoint if cfg["weight_deltas"] else adapter
        if drafter:
            staged = {n: s for n, s in drafter.items() if n not in first["drafter_optional"]}
        self._loop = BackgroundLoop()
        #: The healing fleet (``vllm_cfg.healing``); None when fail-stop.
        self.fleet: Fleet | None = None
        if healing:
            self.fleet = Fleet(
                self.replicas,
                FleetHealth(len(self.replicas), max_restarts=cfg["max_replica_restarts"]),
                loop=self._loop.loop,
                refit_deadline_s=cfg["refit_deadline_s"],
                prepare=self._prepare_replacement,
                weights_absent=cfg["load_format"] == "dummy",
            )
        self._router = RowRouter(
            self.replicas,
            capacity=cfg["max_num_seqs"],
            health=None if self.fleet is None else self.fleet.health,
            on_lost=None if self.fleet is None else self.fleet.lost,
            wedge_timeout_s=cfg["wedge_timeout_s"],
        )
        speculative = config.get("speculative")
        if speculative:
            self._router.speculation.watch_acceptance(
                speculative.get("min_acceptance_rate", DEFAULT_MIN_ACCEPTANCE_RATE),
                f"VllmGeneration ({speculative['method']}, {config['model_name']})",
            )
        if self.fleet is not None:
            self.fleet.router = self._router
            self._loop.loop.call_soon_threadsafe(self._router.watch)
        self._delivery = DeliveryTimes()
        self._calls = itertools.count()
        self._updates = ReplicaUpdateSteps(self.replicas, self.fleet)
        self._trust_remote_code = bool(engine_args.get("trust_remote_code", False))
        self._codec: TextCodec | None = None
        super().__init__(
            config,
            vocab_size=first["vocab_size"],
            context_limit=first["max_model_len"],
            has_tokenizer=not engine_args["skip_tokenizer_init"],
            model_specs={**checkpoint, **adapter, **drafter},
            optional_weights=optional,
            weights_absent=DUMMY_WEIGHTS if cfg["load_format"] == "dummy" else None,
            max_top_logprobs=cfg["max_logprobs"],
            routed_experts=None if self._routing is None else self._routing[:2],
            staged_weights=staged,
        )

    def _serve_adapter(self, config: VllmConfig, checkpoint: TensorSpecs) -> TensorSpecs:
        """Every replica serves the config's LoRA adapter; returns its tensors' specs.

        Raises:
            GenerationConfigError: the section does not fit the model; the engines are shut
                down.
        """
        section = config["lora"]
        assert section is not None
        try:
            settings = lora_settings(section)
            specs = adapter_specs(checkpoint, settings)
            self.replicas.use_adapter(settings, section.get("adapter_path"))
        except (ValueError, OSError) as exc:
            self.replicas.shutdown()
            raise GenerationConfigError(f"lora: {exc}") from exc
        return specs

    def _prepare_replacement(self, actor: Any) -> None:
        """Set a replacement actor up as its peers were at start: the copy of the committed
        weights, the routing capture.

        Raises:
            GenerationError: it cannot be (a LoRA adapter is served: not supported).
        """
        import ray

        if self.config.get("lora"):
            raise GenerationError("a replica that serves a LoRA adapter cannot be replaced yet")
        timeout_s = self.replicas.timeouts.control_s
        if self.committed_copy_bytes:
            ray.get(actor.keep_committed_weights.remote(), timeout=timeout_s)
        if self._routing is not None:
            native = routing_mode(self.config, use_gpus=self.cluster.use_gpus) == "native"
            ray.get(actor.capture_routed_experts.remote(native), timeout=timeout_s)

    def _capture_routing(self, config: VllmConfig, native: bool) -> tuple[int, int, int]:
        """Have every replica return its rows' routing (``native``: vLLM's own option reads
        it): ``(layers, top_k, experts)``.

        Raises:
            GenerationConfigError: an engine cannot (not an MoE model, ...); the engines are
                shut down.
        """
        shapes = self.replicas.capture_routed_experts(native)
        for shape in shapes:
            if isinstance(shape, str):
                self.replicas.shutdown()
                raise GenerationConfigError(
                    f"return_routed_experts is true but vLLM cannot read the routing of model "
                    f"{config['model_name']!r}: {shape}; set it to false"
                )
        layers, top_k, experts = cast(list[int], shapes[0])
        return layers, top_k, experts

    @classmethod
    def create(cls, config: GenerationConfig, **kwargs: Any) -> VllmGeneration:
        """Build from a config alone: ``cluster=`` may be given, else one is made with
        ``replicas=`` bundles (default 1) on this node, on GPUs if Ray sees any (``use_gpus=``
        decides otherwise), and shut down with the backend."""
        cluster = kwargs.pop("cluster", None)
        replicas = kwargs.pop("replicas", 1)
        use_gpus = kwargs.pop("use_gpus", None)
        vllm_config = cast(VllmConfig, config)
        owned = None
        if cluster is None:
            tp = vllm_config.get("vllm_cfg", {}).get("tensor_parallel_size", 1)
            cluster = owned = RayVirtualCluster([replicas * tp], use_gpus=use_gpus)
        try:
            backend = cls(cluster, vllm_config, **kwargs)
        except BaseException:
            if owned is not None:
                owned.shutdown()
            raise
        backend._owned_cluster = owned
        return backend

    @classmethod
    def complete_config(cls, config: Mapping[str, Any]) -> VllmConfig:
        return complete_vllm_config(config)

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def capabilities(self) -> BackendCapabilities:
        on_gpu = self.cluster.use_gpus
        notes = []
        if not self._sleeps:
            notes.append(
                "finish_generation resets the prefix cache and keeps weights and KV cache in "
                "memory ("
                + (
                    "vLLM has no sleep mode on CPU)"
                    if not on_gpu
                    else "not colocated; vllm_cfg.enable_sleep_mode turns sleep on)"
                )
            )
        if not self.has_tokenizer:
            notes.append("no tokenizer loaded: stop strings are refused")
        if not on_gpu:
            notes.append(
                "batch_invariant is refused: vLLM's batch-invariant kernels need CUDA (Triton)"
            )
        return BackendCapabilities(
            sleep=self._sleeps,
            async_generation=True,
            in_flight_updates=True,
            weight_transports=frozenset(
                {"shm", "cuda_ipc", "collective"} if on_gpu else {"shm", "collective"}
            ),
            devices=("cuda",) if on_gpu else ("cpu",),
            score=True,
            stop_strings=self.has_tokenizer,
            token_streaming=True,
            # Two buckets: one is filled while the other loads. On CPU a load (vLLM repacking
            # the layers) keeps every core busy, so the fill hides only partly behind it, and
            # each load pays a fixed cost: larger buckets. On a GPU the fill is a device copy.
            refit_bucket_bytes=(64 if on_gpu else 128) * 2**20,
            refit_buffers=2,
            batch_invariant=on_gpu,
            routed_experts=bool(self.config["vllm_cfg"]["enforce_eager"]) or on_gpu,
            speculative=SPECULATIVE_METHODS,
            notes=tuple(notes),
        )

    def device_ids(self) -> list[list[str]]:
        """Each replica's ranks' device ids (GPU UUIDs, or host and process on CPU)."""
        return [info["device_ids"] for info in self.replicas.infos]

    def rows_in_flight(self) -> list[int]:
        """How many rows each replica's engine holds now (running, queued or paused): rows of
        every call and front end; rows of a closed ``generate_async`` leave at once."""
        return self.replicas.rows_in_flight()

    # ---- generation: rows spread over the replicas, results streamed back per step ----------

    def _run_rows(self, call: GenerationCall, control: RowControl) -> Sequence[RowResult | None]:
        requests, costs = self._requests(call)
        rows: list[RowResult | None] = [None] * call.size
        for index, row in self._loop.run(self._collect(requests, costs)):
            rows[index] = _row_result(cast(RowOutput, row), self._routing)
        return rows

    async def _stream_events(
        self, call: GenerationCall, *, tokens: bool = True
    ) -> AsyncIterator[tuple[int, RowEvent | RowResult]]:
        requests, costs = self._requests(call, stream=tokens)
        timeout_s = self.replicas.timeouts.generate_s
        deliveries = self._router.run(requests, costs, timeout_s, self._loop.loop)
        async for delivery in deliveries:
            self._delivery.record(time.time() - delivery.ended)
            for index, step in delivery.items:
                if isinstance(step, TokenDelta):
                    no_top: list[list[Any]] = [[] for _ in step.token_ids]
                    yield (
                        index,
                        RowEvent(
                            index,
                            step.token_ids,
                            step.logprobs,
                            step.topk_ids or no_top,
                            step.topk_logprobs or no_top,
                        ),
                    )
                else:
                    yield index, _row_result(step, self._routing)

    def _requests(
        self, call: GenerationCall, *, stream: bool = False
    ) -> tuple[list[RowRequest], list[int]]:
        """Each row's request (ids unique among calls in flight) and its token budget;
        ``stream``: the rows report their tokens as they come."""
        _refuse_what_speculation_cannot_sample(call, self.config)
        prompts = call.prompts.prompts()
        params = row_sampling_params(
            call.sampling,
            prompt_lengths=[len(p) for p in prompts],
            context_limit=cast(int, self.context_limit),
        )
        number = next(self._calls)
        sessions = call.prompts.session_ids or [None] * len(prompts)
        requests = [
            RowRequest(f"{number}-{i}", prompt, p, stream, session)
            for i, (prompt, p, session) in enumerate(zip(prompts, params, sessions))
        ]
        return requests, [p["max_tokens"] for p in params]

    async def _collect(self, requests: list[RowRequest], costs: list[int]) -> list[RowItem]:
        timeout_s = self.replicas.timeouts.generate_s
        items: list[RowItem] = []
        # aclosing: a cancelled call (Ctrl-C in generate) closes the router's iterator at once,
        # so its rows are aborted in the engines now, not whenever the iterator is collected
        rows = self._router.run(requests, costs, timeout_s, self._loop.loop)
        async with contextlib.aclosing(rows):
            async for delivery in rows:
                self._delivery.record(time.time() - delivery.ended)
                items.extend(delivery.items)
        return items

    def _score_rows(self, batch: ScoreBatch, top_logprobs: int) -> list[ScoredRow]:
        members = self.replicas.member_ids()
        if not members:
            raise NoReplicaServingError("no replica of the fleet serves: score cannot run")
        shards: list[BatchedDataDict[Any]] = BatchedDataDict(
            rows=batch.sequences, starts=batch.prompt_lengths
        ).shard_by_batch_size(len(members), allow_uneven_shards=True)
        if self.fleet is None:
            results = self.replicas.score(
                [(s["rows"], s["starts"]) if s.size else None for s in shards], top_logprobs
            )
        else:
            results = self._score_healing(shards, members, top_logprobs)
        return [
            _scored_row(row, top_logprobs, self._routing)
            for shard in results
            for row in (shard or [])
        ]

    def _score_healing(
        self, shards: list[BatchedDataDict[Any]], members: list[int], top_logprobs: int
    ) -> list[Any]:
        """Score the shards on ``members``; a shard whose replica is lost runs again on one
        that serves (scores depend only on the sequence and the weights)."""
        assert self.fleet is not None
        results: list[Any] = [None] * len(shards)
        todo = {k: members[k] for k, shard in enumerate(shards) if shard.size}
        while todo:
            by_replica: dict[int, list[int]] = {}
            for k, replica in todo.items():
                by_replica.setdefault(replica, []).append(k)
            work = {
                replica: (
                    [row for k in ks for row in shards[k]["rows"]],
                    [start for k in ks for start in shards[k]["starts"]],
                )
                for replica, ks in by_replica.items()
            }
            outcomes = self.replicas.score_outcomes(work, top_logprobs)
            failed = []
            for replica, outcome in outcomes.items():
                ks = by_replica[replica]
                if isinstance(outcome, WorkerLostError):
                    self.fleet.evict(replica, f"lost while scoring: {outcome}")
                    failed.extend(ks)
                    continue
                if isinstance(outcome, GenerationError):
                    raise outcome
                offset = 0
                for k in ks:
                    size = len(shards[k]["rows"])
                    results[k] = outcome[offset : offset + size]
                    offset += size
            lost = {r for r, o in outcomes.items() if isinstance(o, WorkerLostError)}
            serving = [r for r in self.replicas.member_ids() if r not in lost]
            if failed and not serving:
                raise NoReplicaServingError("no replica of the fleet serves: score cannot finish")
            todo = {k: serving[i % len(serving)] for i, k in enumerate(failed)}
        return results

    def _extra_metrics(self, clear: bool = False) -> dict[str, int | float]:
        """Tokens generated by each replica since the last clear, its engine's steps and the
        seconds they took, the prompt tokens of generated rows that vLLM's prefix caches were
        asked for and held (its own ``num_cached_tokens`` per request), and how long the
        engines' outputs took from the end of the step that made them to this process's router
        and to its caller (``delivery.py``), and speculative decoding's drafts, proposed and
        accepted tokens (``SpeculationCounts``: zeros while it is off)."""
        router = self._router
        if clear:
            router.tokens = [0] * len(router.tokens)
            router.engine_steps = [0] * len(router.engine_steps)
            router.engine_seconds = [0.0] * len(router.engine_seconds)
            router.prompt_tokens = router.cached_tokens = 0
            router.speculation.clear()
            self._delivery.clear()
            router.arrivals.clear()
        return {
            **{f"replica_{i}_tokens_generated_total": n for i, n in enumerate(router.tokens)},
            **{f"replica_{i}_engine_steps_total": n for i, n in enumerate(router.engine_steps)},
            **{
                f"replica_{i}_engine_step_seconds_total": s
                for i, s in enumerate(router.engine_seconds)
            },
            "prefix_cache_queries_total": router.prompt_tokens,
            "prefix_cache_hits_total": router.cached_tokens,
            **router.speculation.metrics(),
            **(
                {"speculative_drafter_weight_version": self.drafter_version}
                if self._has_drafter
                else {}
            ),
            **router.arrivals.snapshot(),
            **self._delivery.snapshot(),
            **(self.fleet.metrics() if self.fleet is not None else {}),
        }

    def _text_codec(self) -> TextCodec | None:
        """The model's tokenizer, loaded in this process on first use (the engines hold their
        own; ``generate_text`` tokenises here and sends ids)."""
        if self._codec is None and self.has_tokenizer:
            from transformers import AutoTokenizer

            self._codec = HfTokenizerCodec(
                AutoTokenizer.from_pretrained(
                    self.config["model_name"], trust_remote_code=self._trust_remote_code
                )
            )
        return self._codec

    # ---- life cycle --------------------------------------------------------------------------

    def invalidate_kv_cache(self) -> bool:
        """Reset every replica's prefix cache; False while some rows still hold blocks."""
        with self.lifecycle.breaks_on_fatal():
            self.lifecycle.check_open(GenerationError)
            return all(self.replicas.reset_prefix_cache())

    def _wake(self, resources: tuple[Resource, ...]) -> None:
        self.replicas.wake_up(list(resources))

    def _release(self) -> frozenset[Resource]:
        self.replicas.reset_prefix_cache()
        if not self._sleeps:
            return frozenset()
        self.replicas.sleep(1)
        return frozenset({"weights", "kv_cache"})

    def _close(self) -> None:
        steps = [
            *([("the fleet's replacements", self.fleet.close)] if self.fleet is not None else []),
            ("the vLLM engines", self.replicas.shutdown),
            ("the driver loop", self._loop.close),
        ]
        owned, self._owned_cluster = self._owned_cluster, None
        if owned is not None:
            steps.append(("the Ray cluster it started", owned.shutdown))
        close_all("VllmGeneration", steps)

    # ---- weights: the workers' side is in update_steps.py -----------------------------------

    def _begin_update(self, version: int, in_flight: InFlight) -> None:
        self._update_carries_drafter = False
        self._updates.begin(version, in_flight)

    def _load_handles(self, handles: Mapping[str, Any]) -> LoadWait:
        self._note_drafter(describe_weight_handles(handles))
        return self._updates.load(LoadInfo(handles=cast(WeightHandles, handles)))

    def _load_broadcast(self, bucket: Mapping[str, Any]) -> None:
        self._note_drafter(slot["name"] for slot in bucket["tensors"])
        # the trainer sends while the workers receive: this load ends when the broadcast does
        self._updates.load(LoadInfo(broadcast=cast(BroadcastBucket, bucket)))()

    def _note_drafter(self, names: Iterable[str]) -> None:
        """The open update carries drafter tensors if any of ``names`` is one."""
        if not self._update_carries_drafter:
            self._update_carries_drafter = any(map(is_drafter_weight, names))

    def _commit_update(self, version: int) -> None:
        self._updates.commit(version)
        if self._update_carries_drafter:
            self.drafter_version = version

    def _abort_update(self, written: bool) -> None:
        self._updates.abort(written)

    def _weight_base(self) -> WeightBase | None:
        """The copy every rank of every replica holds, when they all hold the same one; a base
        of no version (every tensor comes whole) when they differ (a new replica)."""
        if not self.committed_copy_bytes:
            return None
        bases = [base for replica in self.replicas.weight_base() for base in replica]
        if any(base is None for base in bases):
            return None
        first = bases[0]
        assert first is not None
        if any(base != first for base in bases[1:]):
            return WeightBase(version=None, checksum=0, dtypes=first["dtypes"])
        return first

    def collective_ranks(self) -> int:
        """The ranks of the replicas that take updates now (a healing fleet's members and the
        replacements joining its next update)."""
        return sum(len(self.replicas.infos[i]["device_ids"]) for i in self._updated_ids())

    def collective_intact(self) -> bool:
        """The replicas that take updates now are the ones that joined the weight group, each
        with the worker that joined (a replacement or a replica taken in has not)."""
        return self.replicas.in_weight_group(self._updated_ids())

    def init_collective(self, endpoint: Mapping[str, Any]) -> None:
        with self.lifecycle.breaks_on_fatal():
            tp = self.config["vllm_cfg"]["tensor_parallel_size"]
            self.replicas.init_collective(
                cast(CollectiveEndpoint, dict(endpoint)), tp, self._updated_ids()
            )

    def _updated_ids(self) -> list[int]:
        return self.replicas.member_ids() if self.fleet is None else self.fleet.updated_ids()


def _refuse_what_speculation_cannot_sample(call: GenerationCall, config: VllmConfig) -> None:
    """Raise ``GenerationInputError`` for a row that speculative decoding would sample wrongly:
    a sampled row with ``min_p > 0`` (vLLM's speculative sampler has no min_p). (On CPU,
    sampled rows are right only with this project's expand kernel, ``cpu_kernels``, which every
    worker registers.)"""
    section = config.get("speculative")
    if not section:
        return
    for i, row in enumerate(call.sampling.rows):
        if not row.greedy and row.min_p > 0:
            raise GenerationInputError(
                f"sampling row {i}: min_p = {row.min_p} with speculative (method "
                f"{section['method']!r}): vLLM's speculative sampler has no min_p, so the row "
                "cannot be sampled as asked; set its min_p to 0, or build the backend without "
                "speculative"
            )


def _row_result(row: RowOutput, routing: tuple[int, int, int] | None) -> RowResult:
    row = row.unpacked()
    return RowResult.ended(
        row.finish_reason,
        row.token_ids,
        row.logprobs,
        weight_version=row.weight_version,
        weight_versions=row.weight_versions,
        topk_ids=row.topk_ids,
        topk_logprobs=row.topk_logprobs,
        routed_experts=None if routing is None else read_routing(row.routed_experts, routing),
    )


def _scored_row(
    row: ScoredTokens, top_logprobs: int, routing: tuple[int, int, int] | None
) -> ScoredRow:
    shape = (len(row["logprobs"]), top_logprobs)
    return ScoredRow(
        torch.tensor(row["logprobs"], dtype=torch.float32),
        torch.tensor(row["topk_ids"], dtype=torch.int64).reshape(shape),
        torch.tensor(row["topk_logprobs"], dtype=torch.float32).reshape(shape),
        None if routing is None else read_routing(row["routed_experts"], routing),
    )
