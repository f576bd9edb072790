"""``HfGeneration``: the Hugging Face transformers reference backend, in process.

Every other backend is measured against this one, so it decodes with the shared reference
pieces of gen-interface (input normalisation, ``select_next_tokens``, ``StopRules``, the output
layout) on the model's own forward pass and KV cache; see ``decode.py`` for the loop.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
from gen_interface import (
    BackendCapabilities,
    BatchedDataDict,
    GenerationConfigError,
    GenerationDatumSpec,
    GenerationError,
    GenerationInputError,
    GenerationInterface,
    GenerationOutputSpec,
    InFlight,
    PromptBatch,
    RowResult,
    ScoreSpec,
    WeightTransport,
    build_generation_output,
    normalize_generation_input,
    sampling_settings_of,
    with_per_call_overrides,
)
from gen_interface.decoding import StopRules
from gen_interface.lifecycle import DUMMY_WEIGHTS, Lifecycle, LifecycleView, Resource
from gen_interface.outputs import build_row_output
from gen_interface.sampling import is_greedy, row_generators, row_seeds_for
from gen_interface.scoring import normalize_score_input, scatter_response_logprobs
from gen_interface.weights import (
    WeightUpdates,
    WeightUpdateSteps,
    check_weights_match,
    iter_shared_weights,
    release_shared_weights,
)

from gen_hf.config import HfConfig, complete_hf_config
from gen_hf.decode import DecodeCall, SamplingStep, decode_batch
from gen_hf.gate import StepGate
from gen_hf.loading import (
    LoadedModel,
    load_model,
    load_tokenizer_decode,
    move_model,
    resolve_device,
)
from gen_hf.score import score_sequences
from gen_hf.weights import model_tensor_specs, state_dict_specs, tied_aliases, write_weights

__all__ = ["HfGeneration"]


class HfGeneration(GenerationInterface):
    """Any causal LM that ``AutoModelForCausalLM`` loads, on CUDA when present, else the CPU.

    Lifecycle (``gen_interface.lifecycle``): built ready to generate. ``finish_generation()``
    drops what generation holds (the KV cache lives only inside a call; on CUDA with
    ``colocated.enabled`` the weights also move to the CPU, i.e. they sleep); ``generate`` then
    raises ``GenerationError`` until ``prepare_for_generation()``. A weight update while the
    weights sleep moves them back to the device first and leaves the backend finished.
    Model access is serialised by a lock, so ``generate_async``'s thread is safe.
    """

    config_schema: ClassVar[type] = HfConfig
    settings_key: ClassVar[str | None] = "hf_cfg"

    def __init__(self, config: HfConfig):
        """Load the model (and, for stop strings, the tokenizer) named by ``config``.

        Args:
            config: a configured ``HfConfig`` (``configure_generation_config``); ``hf_cfg``
                may be partial, its defaults are filled in.

        Raises:
            GenerationConfigError: a field is out of range, the model does not load, or
                ``stop_strings`` are set and no tokenizer loads from ``model_name``.
            BackendUnavailableError: ``hf_cfg.device`` names a CUDA device that is not present.
        """
        self.config: HfConfig = complete_hf_config(config)
        hf_cfg = self.config["hf_cfg"]
        self._device = resolve_device(hf_cfg["device"])
        self._decode = load_tokenizer_decode(self.config)
        if self.config.get("stop_strings") and self._decode is None:
            raise GenerationConfigError(
                f"stop_strings {self.config['stop_strings']!r} need a tokenizer and none loads "
                f"from model_name {self.config['model_name']!r}; use stop_token_ids, or give a "
                "model directory with a tokenizer"
            )
        self._loaded: LoadedModel | None = load_model(self.config, self._device)
        self._vocab_size = self._loaded.vocab_size
        self._context_limit = self._loaded.context_limit
        self._specs = model_tensor_specs(self._loaded.model)
        self._max_batch_size = int(hf_cfg["max_batch_size"])
        self._offload_on_finish = (
            self._device.type == "cuda" and self.config["colocated"]["enabled"]
        )
        self._lock = threading.Lock()
        self._gate = StepGate(self._lock)
        self._targets: dict[str, torch.Tensor] | None = None
        self._lifecycle: Lifecycle | LifecycleView = Lifecycle(
            "HfGeneration",
            wake=self._wake,
            release=self._release,
            close=self._close,
            weights_absent=DUMMY_WEIGHTS if hf_cfg["load_format"] == "dummy" else None,
        )
        self._weights = WeightUpdates(
            self._lifecycle,
            self._specs,
            tied_aliases(self._loaded.model),
            WeightUpdateSteps(
                load=self._load,
                begin=lambda version, in_flight: self._gate.close(in_flight),
                commit=self._gate.reopen,
                abort=lambda written: self._gate.reopen(None),
            ),
        )

    def with_sampling(self, **overrides: Any) -> HfGeneration:
        """Another front end on the same loaded model, with other per-call settings.

        Only ``PER_CALL_SETTINGS`` may change: ``max_new_tokens``, ``temperature``, ``top_p``,
        ``top_k``, ``stop_token_ids``, ``stop_strings``, ``seed`` and ``max_weight_staleness``. The
        front end shares the model, its weights (updates through either reach both) and its
        lifecycle (finishing either finishes both); shutting the front end down leaves the model
        to its owner.

        Raises:
            GenerationConfigError: an override names another setting, or is out of range.
        """
        view = copy.copy(self)
        view.config = complete_hf_config(with_per_call_overrides(self.config, overrides))
        if view.config.get("stop_strings") and view._decode is None:
            raise GenerationConfigError("stop_strings need a tokenizer and this model has none")
        view._lifecycle = self._lifecycle.view()
        return view

    @property
    def device(self) -> torch.device:
        """Where the model runs while generating."""
        return self._device

    @property
    def capabilities(self) -> BackendCapabilities:
        on_cuda = self._device.type == "cuda"
        transports: set[WeightTransport] = {"shm", "state_dict"}
        if on_cuda:
            transports.add("cuda_ipc")
        notes = ["the KV cache lives only inside a generate call; nothing is cached between calls"]
        if self._offload_on_finish:
            notes.append(
                "finish_generation moves the weights to the CPU and empties the CUDA cache; "
                "prepare_for_generation moves them back"
            )
        elif on_cuda:
            notes.append(
                "finish_generation empties the CUDA cache but keeps the weights on the GPU "
                "(colocated.enabled is false)"
            )
        else:
            notes.append(
                "on the CPU finish_generation keeps the weights in memory: there is no device "
                "memory to give back"
            )
        if self._decode is None:
            notes.append("no tokenizer loads from model_name: stop strings are refused")
        return BackendCapabilities(
            sleep=self._offload_on_finish,
            async_generation=True,
            in_flight_updates=True,
            weight_transports=frozenset(transports),
            devices=(self._device.type,),
            score=True,
            stop_strings=self._decode is not None,
            notes=tuple(notes),
        )

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        prompts, run = self._call(data, greedy)
        self._weights.admit(self.config.get("max_weight_staleness"))
        with self._lifecycle.generating():
            results = run(DecodeCall(self._gate, self._gate.enter()))
        return build_generation_output(prompts, results, self.config["pad_token_id"])

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Yield ``(row index, one-row output)`` as the decode loop finishes each row (rows of
        one forward group finish in any order). Closing the iterator early ends the call at its
        next step."""
        prompts, run = self._call(data, greedy)
        await self._weights.admit_async(self.config.get("max_weight_staleness"))
        pad = self.config["pad_token_id"]
        loop = asyncio.get_running_loop()
        finished: asyncio.Queue[tuple[int, RowResult] | BaseException | None] = asyncio.Queue()
        call = DecodeCall(
            self._gate,
            self._gate.enter(),
            on_row=lambda i, row: loop.call_soon_threadsafe(finished.put_nowait, (i, row)),
        )

        def decode() -> None:
            try:
                run(call)
                loop.call_soon_threadsafe(finished.put_nowait, None)
            except BaseException as exc:
                loop.call_soon_threadsafe(finished.put_nowait, exc)

        with self._lifecycle.generating():
            worker = loop.run_in_executor(None, decode)
            try:
                while (item := await finished.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    index, row = item
                    yield index, build_row_output(prompts, index, row, pad)
            finally:
                call.cancelled.set()
                await asyncio.shield(worker)

    def _call(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> tuple[PromptBatch, Callable[[DecodeCall], list[RowResult]]]:
        """Validate the batch (before anything runs) and return the decoding to run for it."""
        prompts = normalize_generation_input(
            data,
            pad_token_id=self.config["pad_token_id"],
            vocab_size=self._vocab_size,
            context_limit=self._context_limit,
        )
        if self._decode is None and any(prompts.stop_strings):
            row = next(i for i, s in enumerate(prompts.stop_strings) if s)
            raise GenerationInputError(
                f"stop_strings row {row} is {prompts.stop_strings[row]!r}, but stop strings "
                f"need a tokenizer and none loads from {self.config['model_name']!r}; use "
                "stop_token_ids"
            )
        temperature, top_k, top_p = sampling_settings_of(self.config)
        step = SamplingStep(
            greedy=is_greedy(temperature, greedy),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            processed=self.config.get("logprobs_mode") == "processed",
        )
        rules = StopRules.for_call(
            self.config, prompts, context_limit=self._context_limit, decode=self._decode
        )

        def run(call: DecodeCall) -> list[RowResult]:
            return decode_batch(
                self._model(),
                prompts.prompts(),
                rules=rules,
                generators=row_generators(row_seeds_for(prompts, self.config.get("seed"))),
                step=step,
                device=self._device,
                max_batch_size=self._max_batch_size,
                call=call,
            )

        return prompts, run

    def score(self, data: BatchedDataDict[ScoreSpec]) -> torch.Tensor:
        batch = normalize_score_input(data, vocab_size=self._vocab_size)
        with self._lifecycle.generating(), self._gate.step(self._gate.enter()):
            loaded = self._model()
            if not batch.sequences:
                return scatter_response_logprobs(batch, [])
            per_row = score_sequences(
                loaded, batch, device=self._device, max_batch_size=self._max_batch_size
            )
        return scatter_response_logprobs(batch, per_row)

    def prepare_for_generation(
        self, *args: Any, tags: list[str] | None = None, **kwargs: Any
    ) -> None:
        """Move offloaded weights back to the device. ``tags``: see ``GenerationInterface``."""
        self._lifecycle.prepare(tags)

    def finish_generation(self, *args: Any, **kwargs: Any) -> None:
        """Empty the CUDA cache; with ``colocated.enabled`` on CUDA, move the weights to the CPU."""
        self._lifecycle.finish()

    def shutdown(self) -> None:
        """Free the model (a ``with_sampling`` front end only closes itself). Idempotent."""
        self._lifecycle.shutdown()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the model's weights by checkpoint name.

        Raises:
            GenerationError: the backend is shut down.
        """
        with self._lock:
            model = self._model().model
            return {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}

    def prepare_refit_info(
        self, state_dict_info: Mapping[str, tuple[torch.Size, torch.dtype]]
    ) -> None:
        check_weights_match(state_dict_info, self._specs)

    @property
    def weight_version(self) -> int:
        return self._weights.version

    def start_weight_update(
        self, version: int | None = None, *, in_flight: InFlight = "keep"
    ) -> int:
        """Open a transaction; running calls pause at their next decode step (``"keep"``) or
        end there, cut short (``"abort"``): see ``gate.py``."""
        return self._weights.start(version, in_flight)

    def announce_weight_version(self, version: int) -> None:
        self._weights.announce(version)

    def update_weights_from_ipc_handles(self, handles: Mapping[str, Any]) -> None:
        try:
            self._weights.load(handles)
        finally:
            release_shared_weights(handles)

    def commit_weight_update(self) -> int:
        return self._weights.commit()

    def abort_weight_update(self) -> None:
        self._weights.abort()

    def update_weights_from_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load weights from an in-process state dict (checked like an IPC update): every
        weight of the model, or one load of an open transaction.

        Args:
            state_dict: ``{checkpoint name: tensor}`` on any device.

        Raises:
            WeightUpdateError: a name, shape or dtype does not fit the model, or a weight is
                missing (nothing was written), or the backend is shut down.
        """
        self._weights.load_described(
            state_dict_specs(state_dict), lambda: self._write(state_dict.items())
        )

    def _load(self, handles: Mapping[str, Any]) -> None:
        # Each tensor is verified just before it is copied in, while its bytes are in cache.
        self._write(iter_shared_weights(handles))

    def _write(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        with self._lock:
            if self._targets is None:  # the model's tensors by name, while they do not move
                self._targets = self._model().model.state_dict()
            write_weights(self._targets, tensors)

    # ---- internals ----------------------------------------------------------------------

    def _model(self) -> LoadedModel:
        if self._loaded is None:  # a guarded section checked the state; this is a shut-down race
            raise GenerationError("this HfGeneration is shut down; build a new one")
        return self._loaded

    def _wake(self, resources: tuple[Resource, ...]) -> None:
        if "weights" in resources and self._loaded is not None:
            with self._lock:
                move_model(self._loaded.model, self._device)
                self._targets = None

    def _release(self) -> frozenset[Resource]:
        asleep: frozenset[Resource] = frozenset()
        with self._lock:
            if self._offload_on_finish and self._loaded is not None:
                move_model(self._loaded.model, "cpu")
                self._targets = None
                asleep = frozenset({"weights"})
            _release_device_memory(self._device)
        return asleep

    def _close(self) -> None:
        with self._lock:
            self._loaded = None
            self._targets = None
            self._decode = None
            gc.collect()
            _release_device_memory(self._device)


def _release_device_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
