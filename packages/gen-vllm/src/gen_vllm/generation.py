"""``VllmGeneration``: many vLLM engines behind one ``generate`` call."""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, Literal, cast

import torch
from gen_interface import (
    BackendCapabilities,
    BackendUnavailableError,
    BatchedDataDict,
    GenerationConfig,
    GenerationDatumSpec,
    GenerationError,
    GenerationInputError,
    GenerationInterface,
    GenerationOutputSpec,
    RowResult,
    ScoreSpec,
    WeightUpdateError,
    build_generation_output,
    normalize_generation_input,
    sampling_settings_of,
    with_per_call_overrides,
)
from gen_interface.decoding import row_stop_strings
from gen_interface.sampling import is_greedy, row_seeds_for
from gen_interface.scoring import normalize_score_input, scatter_response_logprobs
from gen_interface.weights import describe_weight_handles, release_shared_weights

from gen_vllm.checkpoint import check_update_is_complete
from gen_vllm.cluster import RayVirtualCluster
from gen_vllm.config import VllmConfig, complete_vllm_config
from gen_vllm.engine_args import engine_args_for
from gen_vllm.params import row_sampling_params
from gen_vllm.replicas import ReplicaSet

__all__ = ["VllmGeneration"]

logger = logging.getLogger(__name__)

State = Literal["ready", "finished", "shut down", "broken"]

# A fixed sequence every replica scores after a weight update: identical results prove that all
# replicas run the same weights, packed kernels included.
_PROBE = list(range(3, 35))


class VllmGeneration(GenerationInterface):
    """vLLM engines as Ray actors, one per data-parallel replica.

    ``replicas = cluster bundles / tensor_parallel_size``. ``generate`` validates the batch,
    cuts it into one contiguous shard per replica, runs the shards concurrently and gathers the
    rows back in input order. Row seeds come from the config seed and the row's index in the
    whole batch, so a row's sample does not depend on which replica runs it.

    Args:
        cluster: the resources to run on.
        config: a configured ``VllmConfig`` (``configure_generation_config`` first).
        name_prefix: prefix for the actors' names.

    Raises:
        GenerationConfigError: a config field is out of range.
        BackendUnavailableError: an engine failed to start (its error is in the message).
    """

    config: VllmConfig

    def __init__(self, cluster: RayVirtualCluster, config: VllmConfig, name_prefix: str = "vllm"):
        self.config = complete_vllm_config(config)
        self.cluster = cluster
        self._owned_cluster: RayVirtualCluster | None = None
        self._owner: VllmGeneration | None = None  # set on with_sampling's front ends
        self._lock = threading.Lock()
        self._state: State = "ready"
        tp = self.config["vllm_cfg"]["tensor_parallel_size"]
        if tp > 1 and not cluster.use_gpus:
            raise BackendUnavailableError(
                "tensor_parallel_size > 1 needs GPUs; on CPU run more replicas instead"
            )
        if cluster.world_size % tp:
            raise BackendUnavailableError(
                f"{cluster.world_size} bundles do not split into engines of "
                f"tensor_parallel_size={tp}"
            )
        engine_args = engine_args_for(self.config, use_gpus=cluster.use_gpus)
        self._has_tokenizer = not engine_args["skip_tokenizer_init"]
        self._sleep = bool(engine_args["enable_sleep_mode"])
        self.replicas = ReplicaSet.start(
            cluster,
            self.config["model_name"],
            engine_args,
            tensor_parallel_size=tp,
            name_prefix=name_prefix,
            startup_timeout_s=self.config["vllm_cfg"]["startup_timeout_s"],
        )
        first = self.replicas.infos[0]
        self.vocab_size: int = first["vocab_size"]
        self.context_limit: int = first["max_model_len"]
        self._checkpoint_specs = first["checkpoint_specs"]
        self._optional_weights = set(first["optional_weights"])

    @classmethod
    def create(cls, config: GenerationConfig, **kwargs: Any) -> VllmGeneration:
        """Build from a config alone: ``cluster=`` may be given, else one is made with
        ``replicas=`` bundles (default 1) on this node and shut down with the backend."""
        cluster = kwargs.pop("cluster", None)
        replicas = kwargs.pop("replicas", 1)
        vllm_config = cast(VllmConfig, config)
        owned = None
        if cluster is None:
            tp = vllm_config.get("vllm_cfg", {}).get("tensor_parallel_size", 1)
            cluster = owned = RayVirtualCluster([replicas * tp])
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
        ``temperature``, ``top_p``, ``top_k``, ``stop_token_ids``, ``stop_strings``, ``seed``.
        The new front end shares the engines' lifecycle and weights; shutting it down leaves
        the engines to their owner.

        Raises:
            GenerationConfigError: an override names an engine-level setting, or is out of range.
        """
        view = copy.copy(self)
        view.config = complete_vllm_config(with_per_call_overrides(self.config, overrides))
        view._owner = self
        return view

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def capabilities(self) -> BackendCapabilities:
        on_gpu = self.cluster.use_gpus
        notes = (
            []
            if self._sleep
            else ["vLLM has no sleep mode on CPU: finish_generation only resets the prefix cache"]
        )
        if not self._has_tokenizer:
            notes.append("no tokenizer loaded: stop strings are refused")
        return BackendCapabilities(
            sleep=bool(self._sleep),
            weight_transports=frozenset({"shm", "cuda_ipc"} if on_gpu else {"shm"}),
            devices=("cuda",) if on_gpu else ("cpu",),
            score=True,
            stop_strings=self._has_tokenizer,
            notes=tuple(notes),
        )

    def device_ids(self) -> list[list[str]]:
        """Each replica's workers' device ids (GPU UUIDs, or host and process on CPU)."""
        return [info["device_ids"] for info in self.replicas.infos]

    # ---- generation --------------------------------------------------------------------------

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
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
        with self._lock:
            self._check_ready()
            if not token_lists:
                return build_generation_output(prompts, [], self.config["pad_token_id"])
            outputs = self._run_sharded("generate", token_lists, params)
        rows = [RowResult(tokens, lps, reason == "length") for tokens, lps, reason in outputs]
        return build_generation_output(prompts, rows, self.config["pad_token_id"])

    def score(self, data: BatchedDataDict[ScoreSpec]) -> torch.Tensor:
        batch = normalize_score_input(data, vocab_size=self.vocab_size)
        too_long = [i for i, s in enumerate(batch.sequences) if len(s) >= self.context_limit]
        if too_long:
            raise GenerationInputError(
                f"score row {too_long[0]} has {len(batch.sequences[too_long[0]])} tokens; the "
                f"engine scores sequences shorter than its context limit {self.context_limit}"
            )
        with self._lock:
            self._check_ready()
            if not batch.sequences:
                return scatter_response_logprobs(batch, [])
            per_row = self._run_sharded("score", batch.sequences, batch.prompt_lengths)
        return scatter_response_logprobs(batch, [torch.tensor(r) for r in per_row])

    def _run_sharded(self, method: str, rows: list[Any], extra: list[Any]) -> list[Any]:
        """Split rows into contiguous shards, run one per replica, gather in input order."""
        shards: list[BatchedDataDict[Any]] = BatchedDataDict(
            rows=rows, extra=extra
        ).shard_by_batch_size(self.num_replicas, allow_uneven_shards=True)
        try:
            results = self.replicas.call_each(
                method,
                [(shard["rows"], shard["extra"]) if shard.size else None for shard in shards],
                timeout_s=self.config["vllm_cfg"]["generate_timeout_s"],
            )
        except GenerationError as exc:
            if not isinstance(exc, GenerationInputError | WeightUpdateError):
                self._state = "broken"
            raise
        return [row for shard in results for row in (shard or [])]

    # ---- lifecycle ---------------------------------------------------------------------------

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> None:
        """Wake the engines: weights first, then the KV cache (CUDA sleep mode). Idempotent."""
        with self._lock:
            if self._state in ("shut down", "broken"):
                self._check_ready()
            if self._state == "finished" and self._sleep:
                self.replicas.call_all("wake_up", (["weights"],))
                self.replicas.call_all("wake_up", (["kv_cache"],))
            self._state = "ready"

    def finish_generation(self, *args: Any, **kwargs: Any) -> None:
        """Reset the prefix cache and, where sleep mode is on (CUDA), sleep at level 1."""
        with self._lock:
            if self._state != "ready":
                return
            self.replicas.call_all("reset_prefix_cache", ())
            if self._sleep:
                self.replicas.call_all("sleep", (1,))
            self._state = "finished"

    def shutdown(self) -> None:
        """Stop every engine and actor; remove the cluster if this backend made it. Idempotent.

        A front end made by ``with_sampling`` only stops being usable itself."""
        if self._owner is not None:
            self._owner = None
            self._state = "shut down"
            return
        with self._lock:
            if self._state == "shut down":
                return
            self._state = "shut down"
            self.replicas.shutdown()
            if self._owned_cluster is not None:
                self._owned_cluster.shutdown()
                self._owned_cluster = None

    def _check_ready(self) -> None:
        if self._state == "finished":
            raise GenerationError(
                "generate called after finish_generation(); call prepare_for_generation() first"
            )
        if self._state == "shut down":
            raise GenerationError("this VllmGeneration is shut down; build a new one")
        if self._state == "broken":
            raise GenerationError(
                "a vLLM worker of this VllmGeneration died; shut it down and build a new one"
            )

    # ---- weights -----------------------------------------------------------------------------

    def prepare_refit_info(
        self, state_dict_info: Mapping[str, tuple[torch.Size, torch.dtype]]
    ) -> None:
        check_update_is_complete(state_dict_info, self._checkpoint_specs, self._optional_weights)

    def update_weights_from_ipc_handles(self, handles: Mapping[str, Any]) -> None:
        """Load new weights into every replica and check that all of them took the same update.

        Raises:
            WeightUpdateError: the update does not match the checkpoint (nothing written), or
                the replicas disagree afterwards.
        """
        try:
            check_update_is_complete(
                describe_weight_handles(handles), self._checkpoint_specs, self._optional_weights
            )
            with self._lock:
                if self._state in ("shut down", "broken"):
                    self._check_ready()
                start = time.perf_counter()
                reports = [
                    r
                    for replica in self.replicas.call_all(
                        "update_weights_from_ipc_handles", (dict(handles),)
                    )
                    for r in replica
                ]
                _check_reports_agree(reports)
                if self.num_replicas > 1:
                    self._check_replicas_agree()
                logger.info(
                    "updated weights on %d workers in %.2f s",
                    len(reports),
                    time.perf_counter() - start,
                )
        finally:
            release_shared_weights(handles)

    def _check_replicas_agree(self) -> None:
        probe = [t % self.vocab_size for t in _PROBE[: max(2, self.context_limit - 1)]]
        scores = self.replicas.call_all("score", ([probe], [1]))
        if any(s != scores[0] for s in scores[1:]):
            raise WeightUpdateError(
                "replicas give different logprobs for the same sequence after a weight update; "
                "their weights differ: shut down and rebuild"
            )


def _check_reports_agree(reports: list[dict[str, Any]]) -> None:
    received = {r["received_checksum"] for r in reports}
    loaded = {r["model_checksum"] for r in reports}
    if len(received) > 1 or len(loaded) > 1:
        raise WeightUpdateError(
            f"workers report different checksums after the update (received {sorted(received)}, "
            f"loaded {sorted(loaded)}): the update did not reach every worker intact"
        )
