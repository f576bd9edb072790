"""``GenerationInterface``: the abstract backend a training loop talks to, and its capabilities."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from gen_interface.batched_data_dict import BatchedDataDict
from gen_interface.events import RowEvent
from gen_interface.schema import ForeignKeys
from gen_interface.specs import (
    GenerationConfig,
    GenerationDatumSpec,
    GenerationOutputSpec,
    ScoreOutputSpec,
    ScoreSpec,
)

if TYPE_CHECKING:
    from gen_interface.weights.handles import WeightBase

__all__ = ["BackendCapabilities", "GenerationInterface", "InFlight", "WeightTransport"]

WeightTransport = Literal["shm", "cuda_ipc", "state_dict", "collective"]
#: What a weight update does to rows running when it starts (``start_weight_update``).
InFlight = Literal["keep", "abort"]


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do beyond the three abstract methods.

    Attributes:
        sleep: ``finish_generation`` frees device memory by putting the weights to sleep
            (offloaded or discarded until ``prepare_for_generation``) rather than only dropping
            caches.
        async_generation: ``generate_async`` yields rows as each finishes (True), or only after
            the whole batch is done (False, the default implementation).
        weight_transports: how the backend can receive weights: ``"shm"`` (CPU shared memory)
            and ``"cuda_ipc"`` (CUDA IPC handles) through ``update_weights_from_ipc_handles``;
            ``"collective"`` through ``init_collective`` / ``update_weights_from_collective``
            (workers on other machines); ``"state_dict"`` when it also takes an in-process
            state dict.
        devices: the device types the backend runs on now, e.g. ``("cpu",)`` or ``("cuda",)``.
        score: ``score`` computes teacher-forced logprobs of given sequences.
        stop_strings: stop strings are honoured (needs a tokenizer); False means they are refused.
        in_flight_updates: a weight update may start while rows run: in ``"keep"`` mode they
            pause and go on with the new weights, in ``"abort"`` mode they end at once, marked
            ``cut_short``. False: an update waits for running calls to end.
        token_streaming: ``generate_stream`` yields each token as it is chosen (True), or each
            row's tokens at once when it finishes (False).
        shares_process: the model lives in the caller's process, so ``Refitter`` hands it the
            trainer's tensors in one ``update_weights_from_state_dict`` instead of copying them
            into shared memory for another process to read.
        refit_bucket_bytes: the bucket size a streamed refit (``Refitter``) into this backend
            is fastest with, as measured by ``tools/bench/refit.py``.
        refit_buffers: buckets per place for such a refit: 2 fills one while the backend loads
            the other; 1 when loading needs every core (the fill would only slow it down).
        batch_invariant: ``batch_invariant: true`` is honoured here: every logprob equals, bit
            for bit, the trainer-side ``gen_hf.exact.sequence_logprobs`` of the same tokens,
            whatever the batch. False: the setting is refused (see ``notes`` for why).
        routed_experts: ``return_routed_experts: true`` is honoured for MoE models: outputs carry
            the experts every MoE layer routed each position to. False: the setting is refused.
        notes: one line per limitation worth telling a user, e.g. why ``sleep`` is False.
        speculative: the ``speculative.method`` values honoured here (``SpeculativeConfig``);
            any other is refused by name. Empty: speculation is not offered.
    """

    sleep: bool = False
    async_generation: bool = False
    weight_transports: frozenset[WeightTransport] = frozenset()
    devices: tuple[str, ...] = ("cpu",)
    score: bool = False
    stop_strings: bool = False
    in_flight_updates: bool = False
    token_streaming: bool = False
    shares_process: bool = False
    refit_bucket_bytes: int = 64 * 2**20
    refit_buffers: int = 2
    batch_invariant: bool = False
    routed_experts: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    speculative: frozenset[str] = frozenset()


class GenerationInterface(ABC):
    """A generation backend: token ids in, token ids and log-probabilities out.

    Call order in a training loop: ``prepare_for_generation()`` → ``generate(...)`` (any number
    of times) → ``finish_generation()`` → training step → ``update_weights_from_ipc_handles(...)``
    → ``prepare_for_generation()`` → ... → ``shutdown()``.

    The three abstract methods are the seed interface. Every other method is an optional
    capability with a documented default, so every backend answers it; a capability the backend
    lacks raises ``NotImplementedError`` naming it. ``capabilities`` says which it has.
    """

    config: GenerationConfig

    #: The TypedDict declaring every key of this backend's config (``GenerationConfig`` extended
    #: with the backend's own settings); ``configure_generation_config`` refuses any other key.
    config_schema: ClassVar[type] = GenerationConfig
    #: Keys the schema does not declare that configs written for another framework carry, per
    #: level below the top (dotted path -> key -> rule): accepted while inert, refused with a
    #: reason otherwise.
    config_foreign_keys: ClassVar[ForeignKeys] = {}

    @classmethod
    def create(cls, config: GenerationConfig, **kwargs: Any) -> GenerationInterface:
        """Build the backend from a config; ``create_generation_backend`` calls this.

        The default is ``cls(config, **kwargs)``. A backend whose constructor needs more (a Ray
        cluster, say) overrides it to build the rest from the config and ``kwargs``.
        """
        return cls(config, **kwargs)  # type: ignore[call-arg]

    @classmethod
    def set_weight_loading(cls, config: dict[str, Any], *, read_checkpoint: bool) -> None:
        """Make ``config`` read the checkpoint at start (True), or start without it and wait
        for the first weight update (False); ``configure_generation_config``'s ``is_eval``.

        The default accepts True (nothing to change) and refuses False.

        Raises:
            GenerationConfigError: the backend cannot start without its weights.
        """
        if not read_checkpoint:
            from gen_interface.errors import GenerationConfigError

            raise GenerationConfigError(
                f"backend {config.get('backend')!r} ({cls.__name__}) cannot start without its "
                "weights (is_eval=False): it has no way to skip reading the checkpoint; leave "
                "is_eval out"
            )

    @abstractmethod
    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Generate a continuation for every row of ``data``.

        Args:
            data: a ``GenerationDatumSpec`` batch: ``input_ids`` int64 ``[B, S]`` with
                ``attention_mask`` ``[B, S]`` or ``input_lengths`` ``[B]``.
            greedy: take the argmax at every step, whatever the sampling settings.

        Returns:
            A ``GenerationOutputSpec`` batch with rows in input order.

        Raises:
            GenerationInputError: the batch is malformed; nothing ran and the backend is usable.
            GenerationError: generation failed (a worker died, the backend is finished, ...).
        """

    @abstractmethod
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> None:
        """Make the backend ready to generate (wake weights, then caches). Idempotent.

        Backends accept ``tags``: None (everything) or a subset of ``["weights", "kv_cache"]``,
        waking only those (NeMo RL's refit order: ``tags=["weights"]``, update,
        ``tags=["kv_cache"]``). The backend is ready once nothing is asleep. See
        ``gen_backend_kit.lifecycle`` for the shared state machine.

        Raises:
            GenerationError: the backend is shut down or broken.
        """

    @abstractmethod
    def finish_generation(self, *args: Any, **kwargs: Any) -> None:
        """Release what generation holds until the next ``prepare_for_generation``.

        Afterwards ``generate`` raises ``GenerationError`` until ``prepare_for_generation`` runs;
        finish then prepare leaves weights and outputs unchanged. A weight update while finished
        wakes only the weights (so it writes into live memory) and leaves the backend finished.
        """

    @property
    def capabilities(self) -> BackendCapabilities:
        """What this backend can do. Default: nothing beyond the abstract methods."""
        return BackendCapabilities()

    @property
    def state(self) -> str:
        """``"ready"``, ``"finished"`` (after ``finish_generation``), ``"shut down"`` or
        ``"broken"`` (see ``gen_backend_kit.lifecycle``). Default: ``"ready"``."""
        return "ready"

    def with_sampling(self, **overrides: Any) -> GenerationInterface:
        """Another front end on the same model and weights, with other per-call settings.

        For evaluation with other sampling settings than training, without a second model.
        Only ``PER_CALL_SETTINGS`` may change (``max_new_tokens``, ``temperature``, ``top_p``,
        ``top_k``, ``stop_token_ids``, ``stop_strings``, ``seed``, ``max_weight_staleness``).
        The front end shares the weights (an update through either reaches both) and the
        lifecycle (finishing either finishes both); shutting it down closes only itself.

        Raises:
            GenerationConfigError: an override names another setting, or is out of range.
            NotImplementedError: the backend has no front ends (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support with_sampling")

    def shutdown(self) -> None:
        """Free every resource (processes, devices, shared memory). Idempotent.

        The default does nothing; backends that own resources override it.
        """
        return None

    # ---- weight updates --------------------------------------------------------------------
    #
    # A weight update is a transaction: start_weight_update(version), any number of loads
    # (update_weights_from_ipc_handles or update_weights_from_collective), commit_weight_update().
    # Together the loads carry every weight of the model exactly once (tied weights under one of
    # their names); each load is checked before any of it is written, the commit checks that
    # nothing is missing and that every worker holds the same weights, then sets the version.
    # gen_interface.weights.refit drives the whole sequence from a state dict.

    @property
    def weight_version(self) -> int:
        """The version of the weights generation runs on: 0 for the checkpoint's, then what
        each committed update set. Every output row reports the version it started on."""
        return 0

    def start_weight_update(
        self, version: int | None = None, *, in_flight: InFlight = "keep"
    ) -> int:
        """Open a transaction that will commit ``version`` (default: the current one plus 1).

        Rows running when it opens (``capabilities.in_flight_updates``): with ``"keep"`` they
        pause and, once the update commits, go on with the new weights (the KV cache they
        built stays; each token's ``weight_versions`` entry says which weights produced it);
        with ``"abort"`` they end at once with their tokens so far, marked ``cut_short``.
        Backends without in-flight updates wait for running calls to end, whatever the mode.

        Returns:
            The version the commit will set.

        Raises:
            WeightUpdateError: a transaction is already open, the version is not an integer
                >= 0, or the backend is shut down or broken.
            NotImplementedError: the backend cannot update weights (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support start_weight_update")

    def announce_weight_version(self, version: int) -> None:
        """Say that the trainer's weights reached ``version``, whether or not they are sent yet.

        Only the config's ``max_weight_staleness`` (N) reads it: rows then start only on weights
        at most N versions behind the newest version announced (here, or by
        ``start_weight_update``). A call whose rows would start on older weights waits for an
        update in progress that closes the gap, or raises ``StaleWeightsError`` when none is
        open. Announcing an older version than one announced before changes nothing. Rows
        already running are not stopped: their ``weight_versions`` say what produced each token.

        Raises:
            WeightUpdateError: ``version`` is not an integer >= 0.
            NotImplementedError: the backend cannot update weights (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support announce_weight_version")

    def update_weights_from_ipc_handles(self, handles: Mapping[str, Any]) -> None:
        """Load weights shared by ``gen_interface.weights`` (``share_weights`` or a ``refit``).

        Inside a transaction: one load. Outside one: a complete transaction of its own (start,
        this load, commit), so the handles must carry every weight. Names use the model's
        checkpoint (Hugging Face) names; floating-point weights in another floating-point dtype
        are cast. A load that does not fit is refused before any of it is written; a refused
        single-call update leaves the old weights in force. Shared segments made by
        ``share_weights`` are released once every worker has read them.

        Raises:
            WeightUpdateError: the update does not fit the model, is incomplete, or did not
                take on every worker.
            NotImplementedError: the backend cannot update weights (the default).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not support update_weights_from_ipc_handles"
        )

    def update_weights_from_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load weights from an in-process state dict (``capabilities.weight_transports`` has
        ``"state_dict"``), checked like ``update_weights_from_ipc_handles``: one load of the
        open transaction, or a complete transaction of its own.

        Raises:
            WeightUpdateError: as ``update_weights_from_ipc_handles``.
            NotImplementedError: the backend runs in another process (the default).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not support update_weights_from_state_dict"
        )

    def collective_ranks(self) -> int:
        """How many processes receive a broadcast of the weights (``"collective"`` transport).

        Raises:
            NotImplementedError: the backend has no collective path (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support collective_ranks")

    def collective_intact(self) -> bool:
        """Whether the weight group the last ``init_collective`` formed still holds exactly the
        workers that take updates now, each the same process. False after a healing fleet
        replaced a member or took one in: a broadcast would wait on a member that is gone, so
        ``WeightBroadcaster`` forms the group again before it sends. The default, True, suits a
        backend whose workers never change."""
        return True

    def init_collective(self, endpoint: Mapping[str, Any]) -> None:
        """Have every worker join the trainer's weight group; returns once the group formed.

        Call it while the trainer joins as rank 0, as ``WeightBroadcaster.connect`` does.

        Args:
            endpoint: a ``gen_interface.weights.collective.CollectiveEndpoint``.

        Raises:
            WeightUpdateError: the group did not form in time.
            NotImplementedError: the backend has no collective path (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support init_collective")

    def update_weights_from_collective(self, bucket: Mapping[str, Any]) -> None:
        """Receive one broadcast bucket in every worker and load it: one load of the open
        transaction, or a complete transaction of its own. Returns once every worker loaded
        it; the trainer broadcasts meanwhile (``WeightBroadcaster.refit`` does both).

        Args:
            bucket: a ``gen_interface.weights.collective.BroadcastBucket``.

        Raises:
            WeightUpdateError: as ``update_weights_from_ipc_handles``.
            NotImplementedError: the backend has no collective path (the default).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not support update_weights_from_collective"
        )

    def weight_base(self) -> WeightBase | None:
        """The committed weights this backend takes deltas against, or None when it takes none
        (the default, and whenever a delta could not be applied: weights part old, part new).

        A backend that answers keeps a readable copy of its last committed weights (its
        README says where, and what it costs). A weight update may then carry any tensor as a
        delta against that copy (``gen_interface.weights.delta``): each delta names the base
        version and the base tensor's checksum, and is refused (``WeightBaseError``) before
        anything is written when they are not the backend's; the tensor it makes must have
        the trainer's checksum, or the update aborts with the old weights in force.
        ``Refitter`` reads this before every refit that may send deltas.

        Returns:
            ``WeightBase``: the version and checksum of the copy (version None before anything
            was committed into it) and each weight's dtype there.
        """
        return None

    def commit_weight_update(self, version: int | None = None) -> int:
        """Close the open transaction: check that every weight arrived and every worker took
        the same weights, then set the weight version.

        Args:
            version: the version to label the new weights with, when it is only known now
                (vLLM's ``finish_weight_update(weight_version)``); default: the one
                ``start_weight_update`` chose.

        Returns:
            The committed version.

        Raises:
            WeightUpdateError: no transaction is open, ``version`` is not an integer >= 0,
                weights are missing (the transaction is aborted), or workers disagree (the
                backend is then broken).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support commit_weight_update")

    def generate_text(self, data: Mapping[str, Any], greedy: bool = False) -> BatchedDataDict[Any]:
        """NeMo RL's text path: ``{"prompts": [str, ...]}`` (optionally ``"stop_strings"``, a list
        per row) in, ``{"texts": [str, ...]}`` out: each prompt tokenised by the backend's
        tokenizer (special tokens added), generated as ``generate`` would, and its new tokens
        decoded (special tokens skipped, a stop string kept). ``gen_backend_kit.text``.

        Raises:
            GenerationError: the backend has no tokenizer.
            GenerationInputError: no ``prompts``, or not a list of strings.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support generate_text")

    def get_logger_metrics(self) -> dict[str, int | float]:
        """What the backend did since ``clear_logger_metrics`` (NeMo RL's names): rows and
        tokens generated, rows running now and at most, row and first-token times, tokens per
        second, refits and their seconds and bytes, the weight version, rows refused or held by
        the staleness bound, tokens per weight version behind the newest. The names are listed
        in ``gen_backend_kit.metrics``; the default reports nothing."""
        return {}

    def clear_logger_metrics(self) -> None:
        """Start counting anew (gauges such as rows running keep their values)."""
        return None

    def invalidate_kv_cache(self) -> bool:
        """Drop cached keys and values of finished prompts (a prefix cache), so later rows
        recompute them; NeMo RL's name. Rows running keep theirs.

        Returns:
            True when nothing stays cached (the default: the backend caches nothing between
            calls), False when the cache could not be dropped yet (rows still hold it).
        """
        return True

    def abort_weight_update(self) -> None:
        """Drop the open transaction (a no-op when none is open).

        If no load was written yet, the old weights stay in force. If some were, the weights
        are now part old, part new: the backend refuses to generate until a complete update
        commits, rather than sample from mixed weights.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support abort_weight_update")

    def prepare_refit_info(
        self, state_dict_info: Mapping[str, tuple[torch.Size, torch.dtype]]
    ) -> None:
        """Tell the backend which tensors future updates will carry: ``{name: (shape, dtype)}``.

        Backends check the info against their model, so a trainer learns at set-up, not at the
        first update, that its names or shapes do not match.

        Raises:
            WeightUpdateError: the info names a tensor the model lacks or with another shape.
            NotImplementedError: the backend cannot update weights (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support prepare_refit_info")

    def score(self, data: BatchedDataDict[ScoreSpec]) -> torch.Tensor:
        """Teacher-forced log-probabilities of complete sequences.

        Args:
            data: a ``ScoreSpec`` batch: ``input_ids`` int64 ``[B, L]`` (prompt then response,
                right-padded), ``prompt_lengths`` and ``unpadded_sequence_lengths`` int64 ``[B]``.
                A ``generate`` output with ``prompt_lengths`` added fits (``output_ids`` is read
                when ``input_ids`` is absent).

        Returns:
            float32 ``[B, L]`` in the output layout's convention: position ``p_i + j`` holds the
            raw log-probability of response token j given everything before it; every other
            position (prompt, padding) is 0.0.

        Raises:
            GenerationInputError: the sequences are malformed.
            NotImplementedError: the backend cannot score (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support score")

    def score_top_logprobs(
        self, data: BatchedDataDict[ScoreSpec], top_logprobs: int
    ) -> BatchedDataDict[ScoreOutputSpec]:
        """``score``, plus the ``top_logprobs`` likeliest tokens at every response position:
        what a distillation teacher returns, and a server's ``prompt_logprobs``.

        Returns:
            ``logprobs`` float32 ``[B, L]`` (``score``'s), ``topk_ids`` int64 and
            ``topk_logprobs`` float32 ``[B, L, top_logprobs]``: raw log-probabilities, most
            likely first; -1 and 0.0 outside the responses.

        Raises:
            GenerationInputError: the sequences are malformed or ``top_logprobs`` is not an
                integer >= 0.
            NotImplementedError: the backend cannot score (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support score_top_logprobs")

    async def generate_stream(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncGenerator[RowEvent, None]:
        """Yield ``RowEvent``s: each row's tokens as they are chosen (``capabilities.
        token_streaming``), or all at once when it finishes (the default, on
        ``generate_async``). A row's events carry its tokens in order, each once; its last
        event carries its one-row output, exactly what ``generate_async`` yields for it.
        Closing the iterator early ends the rows not yet finished.
        """
        async for index, row in self.generate_async(data, greedy):
            start = int(row["unpadded_sequence_lengths"][0] - row["generation_lengths"][0])
            tokens = row["output_ids"][0, start:].tolist()
            no_top: list[list[Any]] = [[] for _ in tokens]
            yield RowEvent(
                index,
                tokens,
                row["logprobs"][0, start:].tolist(),
                row["topk_ids"][0, start:].tolist() if "topk_ids" in row else no_top,
                row["topk_logprobs"][0, start:].tolist() if "topk_ids" in row else no_top,
                row,
            )

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncGenerator[tuple[int, BatchedDataDict[GenerationOutputSpec]], None]:
        """Yield ``(row index, one-row output)`` as rows finish.

        The default runs ``generate`` in a thread and then yields every row in input order;
        backends with ``capabilities.async_generation`` yield each row as soon as it finishes.
        Each one-row output is trimmed to its own ``unpadded_sequence_lengths``.
        """
        output = await asyncio.to_thread(self.generate, data, greedy)
        width_of_all = output["output_ids"].shape[1] if output.size else 0
        for i in range(output.size):
            row = output.slice(i, i + 1)
            width = int(row["unpadded_sequence_lengths"][0])
            for key, value in row.items():  # every [B, L, ...] field
                wide = isinstance(value, torch.Tensor) and value.dim() >= 2
                if wide and value.shape[1] == width_of_all:
                    row[key] = value[:, :width]
            yield i, row
