"""``VllmGeneration``: many vLLM engines behind one ``generate`` call."""

from __future__ import annotations

import copy
import itertools
from collections.abc import AsyncIterator, Mapping
from typing import Any, ClassVar, cast

import torch
from gen_interface import (
    BackendCapabilities,
    BackendUnavailableError,
    BatchedDataDict,
    GenerationConfig,
    GenerationDatumSpec,
    GenerationInputError,
    GenerationInterface,
    GenerationOutputSpec,
    InFlight,
    PromptBatch,
    RowResult,
    ScoreSpec,
    build_generation_output,
    normalize_generation_input,
    sampling_settings_of,
    with_per_call_overrides,
)
from gen_interface.decoding import row_stop_strings
from gen_interface.lifecycle import DUMMY_WEIGHTS, Lifecycle, LifecycleView, Resource
from gen_interface.outputs import build_row_output
from gen_interface.sampling import is_greedy, row_seeds_for
from gen_interface.schema import ForeignKeys
from gen_interface.scoring import normalize_score_input, scatter_response_logprobs
from gen_interface.weights import (
    WeightUpdates,
    check_update_is_complete,
    check_weights_match,
    release_shared_weights,
)
from gen_interface.weights.collective import BroadcastBucket, CollectiveEndpoint
from gen_interface.weights.handles import WeightHandles, describe_slots

from gen_vllm.background_loop import BackgroundLoop
from gen_vllm.cluster import RayVirtualCluster
from gen_vllm.config import VLLM_FOREIGN_KEYS, VllmConfig, complete_vllm_config
from gen_vllm.engine import EngineFactory
from gen_vllm.engine_args import engine_args_for
from gen_vllm.messages import RowOutput, RowRequest
from gen_vllm.params import row_sampling_params
from gen_vllm.receive import LoadInfo
from gen_vllm.replicas import ReplicaSet, Timeouts
from gen_vllm.router import RowRouter
from gen_vllm.update_steps import ReplicaUpdateSteps, failures_break

__all__ = ["VllmGeneration"]


class VllmGeneration(GenerationInterface):
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

    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: VllmConfig,
        name_prefix: str = "vllm",
        *,
        engine_factory: EngineFactory | None = None,
    ):
        self.config = complete_vllm_config(config)
        self.cluster = cluster
        self._owned_cluster: RayVirtualCluster | None = None
        cfg = self.config["vllm_cfg"]
        tp = cfg["tensor_parallel_size"]
        if tp > 1 and not cluster.use_gpus:
            raise BackendUnavailableError(
                "tensor_parallel_size > 1 needs GPUs; on CPU run more replicas instead"
            )
        cluster.engine_groups(tp)  # refuses layouts where an engine would span nodes
        engine_args = engine_args_for(self.config, use_gpus=cluster.use_gpus)
        self._has_tokenizer = not engine_args["skip_tokenizer_init"]
        self._sleeps = bool(engine_args["enable_sleep_mode"])
        self.replicas = ReplicaSet.start(
            cluster,
            self.config["model_name"],
            engine_args,
            tensor_parallel_size=tp,
            name_prefix=name_prefix,
            timeouts=Timeouts(
                startup_s=cfg["startup_timeout_s"],
                generate_s=cfg["generate_timeout_s"],
                update_s=cfg["update_timeout_s"],
                control_s=cfg["control_timeout_s"],
            ),
            engine_factory=engine_factory,
        )
        first = self.replicas.infos[0]
        self.vocab_size: int = first["vocab_size"]
        self.context_limit: int = first["max_model_len"]
        checkpoint = {
            name: (torch.Size(shape), getattr(torch, dtype))
            for name, (shape, dtype) in first["checkpoint_specs"].items()
        }
        self._loop = BackgroundLoop()
        self._router = RowRouter(self.replicas, capacity=cfg["max_num_seqs"])
        self._calls = itertools.count()
        self._lifecycle: Lifecycle | LifecycleView = Lifecycle(
            "VllmGeneration",
            wake=self._wake,
            release=self._release,
            close=self._close,
            weights_absent=DUMMY_WEIGHTS if cfg["load_format"] == "dummy" else None,
        )
        self._updates = ReplicaUpdateSteps(
            self.replicas,
            self._lifecycle,
            vocab_size=self.vocab_size,
            context_limit=self.context_limit,
        )
        self._weights = WeightUpdates(
            self._lifecycle,
            checkpoint,
            first["optional_weights"],
            self._updates.steps(
                lambda handles: self._updates.load(LoadInfo(handles=cast(WeightHandles, handles)))
            ),
        )

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

    def with_sampling(self, **overrides: Any) -> VllmGeneration:
        """Another front end on the same engines, with other per-request settings.

        For evaluation with other sampling settings than training, without a second set of
        engines. Only settings vLLM takes per request may change: ``max_new_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``stop_token_ids``, ``stop_strings``, ``seed``; and
        ``max_weight_staleness``, which the front end checks before any request is sent.
        The front end shares the engines, their weights and their lifecycle (finishing either
        finishes both); shutting it down closes only the front end.

        Raises:
            GenerationConfigError: an override names an engine-level setting, or is out of range.
        """
        view = copy.copy(self)
        view.config = complete_vllm_config(with_per_call_overrides(self.config, overrides))
        view._lifecycle = self._lifecycle.view()
        return view

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
        if not self._has_tokenizer:
            notes.append("no tokenizer loaded: stop strings are refused")
        return BackendCapabilities(
            sleep=self._sleeps,
            async_generation=True,
            in_flight_updates=True,
            weight_transports=frozenset(
                {"shm", "cuda_ipc", "collective"} if on_gpu else {"shm", "collective"}
            ),
            devices=("cuda",) if on_gpu else ("cpu",),
            score=True,
            stop_strings=self._has_tokenizer,
            notes=tuple(notes),
        )

    def device_ids(self) -> list[list[str]]:
        """Each replica's ranks' device ids (GPU UUIDs, or host and process on CPU)."""
        return [info["device_ids"] for info in self.replicas.infos]

    def rows_in_flight(self) -> list[int]:
        """How many rows each replica's engine holds now (running, queued or paused): rows of
        every call and front end; rows of a closed ``generate_async`` leave at once."""
        return self.replicas.rows_in_flight()

    # ---- generation ------------------------------------------------------------------------

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        prompts, requests, costs = self._requests(data, greedy)
        self._weights.admit(self.config.get("max_weight_staleness"))
        with self._lifecycle.generating():
            rows: list[RowOutput | None] = [None] * len(requests)
            with failures_break(self._lifecycle):
                for index, row in self._loop.run(self._collect(requests, costs)):
                    rows[index] = row
        results = [_row_result(row) for row in rows if row is not None]
        return build_generation_output(prompts, results, self.config["pad_token_id"])

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Yield ``(row index, one-row output)`` as each row finishes, on any replica.

        The same core as ``generate``: the outputs are the rows ``generate`` would return.
        Closing the iterator early aborts the rows not yet returned.
        """
        prompts, requests, costs = self._requests(data, greedy)
        await self._weights.admit_async(self.config.get("max_weight_staleness"))
        pad = self.config["pad_token_id"]
        with self._lifecycle.generating(), failures_break(self._lifecycle):
            rows = self._loop.stream(
                lambda: self._router.run(requests, costs, self.replicas.timeouts.generate_s)
            )
            async for index, row in rows:
                yield index, build_row_output(prompts, index, _row_result(row), pad)

    def score(self, data: BatchedDataDict[ScoreSpec]) -> torch.Tensor:
        batch = normalize_score_input(data, vocab_size=self.vocab_size)
        too_long = [i for i, s in enumerate(batch.sequences) if len(s) >= self.context_limit]
        if too_long:
            raise GenerationInputError(
                f"score row {too_long[0]} has {len(batch.sequences[too_long[0]])} tokens; the "
                f"engine scores sequences shorter than its context limit {self.context_limit}"
            )
        with self._lifecycle.generating():
            if not batch.sequences:
                return scatter_response_logprobs(batch, [])
            shards: list[BatchedDataDict[Any]] = BatchedDataDict(
                rows=batch.sequences, starts=batch.prompt_lengths
            ).shard_by_batch_size(self.num_replicas, allow_uneven_shards=True)
            with failures_break(self._lifecycle):
                results = self.replicas.score(
                    [(s["rows"], s["starts"]) if s.size else None for s in shards]
                )
        per_row = [row for shard in results for row in (shard or [])]
        return scatter_response_logprobs(batch, [torch.tensor(r) for r in per_row])

    def _requests(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> tuple[PromptBatch, list[RowRequest], list[int]]:
        """Validate the batch and build each row's request, before any worker is touched."""
        prompts = normalize_generation_input(
            data,
            pad_token_id=self.config["pad_token_id"],
            vocab_size=self.vocab_size,
            context_limit=self.context_limit,
        )
        stop_strings = row_stop_strings(self.config, prompts)
        if any(stop_strings) and not self._has_tokenizer:
            raise GenerationInputError(
                "stop_strings need a tokenizer, and this engine runs without one "
                "(vllm_cfg.load_tokenizer); use stop_token_ids"
            )
        temperature, _, _ = sampling_settings_of(self.config)
        token_lists = prompts.prompts()
        params = row_sampling_params(
            self.config,
            greedy=is_greedy(temperature, greedy),
            seeds=row_seeds_for(prompts, self.config.get("seed")),
            prompt_lengths=[len(p) for p in token_lists],
            stop_strings=stop_strings,
            context_limit=self.context_limit,
        )
        call = next(self._calls)
        requests = [
            RowRequest(f"{call}-{i}", prompt, p)
            for i, (prompt, p) in enumerate(zip(token_lists, params))
        ]
        return prompts, requests, [p["max_tokens"] for p in params]

    async def _collect(
        self, requests: list[RowRequest], costs: list[int]
    ) -> list[tuple[int, RowOutput]]:
        timeout_s = self.replicas.timeouts.generate_s
        return [item async for item in self._router.run(requests, costs, timeout_s)]

    # ---- lifecycle ---------------------------------------------------------------------------

    def prepare_for_generation(
        self, *args: Any, tags: list[str] | None = None, **kwargs: Any
    ) -> None:
        """Wake what ``finish_generation`` put to sleep: weights first, then the KV cache.

        ``tags`` (NeMo RL's): wake only ``"weights"`` and/or ``"kv_cache"``. Idempotent.
        """
        with failures_break(self._lifecycle):
            self._lifecycle.prepare(tags)

    def finish_generation(self, *args: Any, **kwargs: Any) -> None:
        """Reset the prefix cache and, when sleeping on finish (colocated on CUDA), sleep at
        level 1: weights offloaded to host memory, KV cache freed."""
        with failures_break(self._lifecycle):
            self._lifecycle.finish()

    def shutdown(self) -> None:
        """Stop every engine and actor; remove the cluster if this backend made it. Idempotent.

        A front end made by ``with_sampling`` only closes itself."""
        self._lifecycle.shutdown()

    def _wake(self, resources: tuple[Resource, ...]) -> None:
        self.replicas.wake_up(list(resources))

    def _release(self) -> frozenset[Resource]:
        self.replicas.reset_prefix_cache()
        if not self._sleeps:
            return frozenset()
        self.replicas.sleep(1)
        return frozenset({"weights", "kv_cache"})

    def _close(self) -> None:
        self.replicas.shutdown()
        self._loop.close()
        if self._owned_cluster is not None:
            self._owned_cluster.shutdown()
            self._owned_cluster = None

    # ---- weights: WeightUpdates holds the rules, update_steps.py the workers' side -----------

    @property
    def weight_version(self) -> int:
        return self._weights.version

    def prepare_refit_info(
        self, state_dict_info: Mapping[str, tuple[torch.Size, torch.dtype]]
    ) -> None:
        check_weights_match(state_dict_info, self._weights.model)
        check_update_is_complete(state_dict_info, self._weights.model, self._weights.optional)

    def start_weight_update(
        self, version: int | None = None, *, in_flight: InFlight = "keep"
    ) -> int:
        return self._weights.start(version, in_flight)

    def announce_weight_version(self, version: int) -> None:
        self._weights.announce(version)

    def update_weights_from_ipc_handles(self, handles: Mapping[str, Any]) -> None:
        """Load shared buckets into every replica: one load of the open transaction, or a
        complete update of its own (see ``GenerationInterface``).

        Raises:
            WeightUpdateError: the update does not fit the checkpoint or is incomplete (nothing
                written); a load failed (generation then waits for a complete update); or the
                replicas disagree afterwards (the backend is then broken).
        """
        try:
            self._weights.load(handles)
        finally:
            release_shared_weights(handles)

    def update_weights_from_collective(self, bucket: Mapping[str, Any]) -> None:
        specs = describe_slots(bucket["tensors"])
        self._weights.load_described(
            specs, lambda: self._updates.load(LoadInfo(broadcast=cast(BroadcastBucket, bucket)))
        )

    def commit_weight_update(self) -> int:
        return self._weights.commit()

    def abort_weight_update(self) -> None:
        self._weights.abort()

    def collective_ranks(self) -> int:
        return sum(len(info["device_ids"]) for info in self.replicas.infos)

    def init_collective(self, endpoint: Mapping[str, Any]) -> None:
        with failures_break(self._lifecycle):
            tp = self.config["vllm_cfg"]["tensor_parallel_size"]
            self.replicas.init_collective(cast(CollectiveEndpoint, dict(endpoint)), tp)


def _row_result(row: RowOutput) -> RowResult:
    return RowResult(
        row.token_ids,
        row.logprobs,
        row.finish_reason == "length",
        cut_short=row.finish_reason == "abort",
        weight_version=row.weight_version,
        weight_versions=row.weight_versions,
    )
