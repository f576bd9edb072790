"""``HfGeneration``: the Hugging Face transformers reference backend, in process.

Every other backend is measured against this one, so it decodes with the shared reference
pieces of gen-interface (input normalisation, per-row sampling, ``select_next_tokens``,
``StopRules``, the output layout) on the model's own forward pass and KV cache; see
``decode.py`` for the loop. ``InProcessBackend`` holds everything else (the shared public
methods, the gate between decode steps and weight updates); this class is the steps that make
the backend: decoding, scoring, moving weights, writing them.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from gen_backend_kit import GenerationCall, RowResult
from gen_backend_kit.decoding import StopRules
from gen_backend_kit.in_process import InProcessBackend
from gen_backend_kit.lifecycle import DUMMY_WEIGHTS, Resource, close_all
from gen_backend_kit.sampling import row_generators
from gen_backend_kit.scoring import ScoreBatch, ScoredRow
from gen_backend_kit.stepping import RowControl
from gen_backend_kit.text import HfTokenizerCodec, TextCodec
from gen_interface import (
    BackendCapabilities,
    BackendUnavailableError,
    GenerationConfigError,
    GenerationError,
    WeightTransport,
)

from gen_hf.config import HfConfig, complete_hf_config
from gen_hf.decode import DecodeCall, decode_batch
from gen_hf.exact import use_batch_invariant_kernels
from gen_hf.loading import (
    LoadedModel,
    load_model,
    load_tokenizer,
    move_model,
    resolve_device,
)
from gen_hf.lora import LoraAdapter
from gen_hf.routing import routing_capture
from gen_hf.score import score_sequences
from gen_hf.weights import model_tensor_specs, tied_aliases, write_weights

__all__ = ["HfGeneration"]


class HfGeneration(InProcessBackend):
    """Any causal LM that ``AutoModelForCausalLM`` loads, on CUDA when present, else the CPU.

    Lifecycle (``gen_backend_kit.lifecycle``): built ready to generate. ``finish_generation()``
    drops what generation holds (the KV cache lives only inside a call; on CUDA with
    ``colocated.enabled`` the weights also move to the CPU, i.e. they sleep); ``generate`` then
    raises ``GenerationError`` until ``prepare_for_generation()``. A weight update while the
    weights sleep moves them back to the device first and leaves the backend finished.
    Forward passes and weight writes take turns through one ``StepGate``, so ``generate_async``'s
    thread is safe and an update in flight lands between decode steps.
    """

    config: HfConfig
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
            BackendUnavailableError: ``hf_cfg.device`` names a CUDA device that is not present;
                ``batch_invariant`` is set and the device is not the CPU, or this machine's
                kernels do not keep the promise for the model (``gen_hf.exact``).
        """
        config = self.complete_config(config)
        hf_cfg = config["hf_cfg"]
        self._device = resolve_device(hf_cfg["device"])
        self._tokenizer = load_tokenizer(config)
        self._decode = None if self._tokenizer is None else self._tokenizer.decode
        if config.get("stop_strings") and self._decode is None:
            raise GenerationConfigError(
                f"stop_strings {config['stop_strings']!r} need a tokenizer and none loads "
                f"from model_name {config['model_name']!r}; use stop_token_ids, or give a "
                "model directory with a tokenizer"
            )
        if config.get("batch_invariant", False) and self._device.type != "cpu":
            raise BackendUnavailableError(
                "batch_invariant is true but gen-hf's batch-invariant kernels are verified on "
                f"the CPU only, and hf_cfg.device resolves to {self._device}; set "
                "hf_cfg.device to 'cpu', or use backend 'vllm' on CUDA"
            )
        self._loaded: LoadedModel | None = load_model(config, self._device)
        if config.get("batch_invariant", False):
            use_batch_invariant_kernels(self._loaded.model)
        self._routing = routing_capture(self._loaded.model, config)
        self._lora = _adapter(self._loaded.model, config)
        adapter_specs = self._lora.specs() if self._lora is not None else {}
        self._max_batch_size = int(hf_cfg["max_batch_size"])
        self._offload_on_finish = self._device.type == "cuda" and config["colocated"]["enabled"]
        self._targets: dict[str, torch.Tensor] | None = None
        super().__init__(
            config,
            vocab_size=self._loaded.vocab_size,
            context_limit=self._loaded.context_limit,
            has_tokenizer=self._decode is not None,
            model_specs={**model_tensor_specs(self._loaded.model), **adapter_specs},
            optional_weights=tied_aliases(self._loaded.model),
            weights_absent=DUMMY_WEIGHTS if hf_cfg["load_format"] == "dummy" else None,
            routed_experts=None if self._routing is None else self._routing.shape,
            staged_weights=adapter_specs,
        )

    @classmethod
    def complete_config(cls, config: Mapping[str, Any]) -> HfConfig:
        return complete_hf_config(config)

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
        if on_cuda:
            notes.append(
                "batch_invariant is refused on CUDA: the kernels are verified on the CPU only"
            )
        return BackendCapabilities(
            sleep=self._offload_on_finish,
            async_generation=True,
            in_flight_updates=True,
            token_streaming=True,
            weight_transports=frozenset(transports),
            shares_process=True,
            devices=(self._device.type,),
            score=True,
            stop_strings=self._decode is not None,
            batch_invariant=not on_cuda,
            routed_experts=True,
            notes=tuple(notes),
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the model's weights by checkpoint name.

        Raises:
            GenerationError: the backend is shut down.
        """
        with self.gate.lock:
            model = self._model().model
            return {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}

    # ---- generation --------------------------------------------------------------------------

    def _run_rows(self, call: GenerationCall, control: RowControl) -> Sequence[RowResult | None]:
        decoding = DecodeCall(
            sampling=call.sampling,
            rules=StopRules.for_call(
                call.sampling, context_limit=self.context_limit, decode=self._decode
            ),
            generators=row_generators([row.seed for row in call.sampling.rows]),
            gate=self.gate,
            mark=self.gate.enter(),
            control=control,
            routing=self._routing,
        )
        return decode_batch(
            self._model(),
            call.prompts.prompts(),
            device=self._device,
            max_batch_size=self._max_batch_size,
            call=decoding,
        )

    def _score_rows(self, batch: ScoreBatch, top_logprobs: int) -> list[ScoredRow]:
        with self.gate.step(self.gate.enter()):
            return score_sequences(
                self._model(),
                batch,
                device=self._device,
                max_batch_size=self._max_batch_size,
                top_logprobs=top_logprobs,
                routing=self._routing,
            )

    # ---- life cycle --------------------------------------------------------------------------

    def _wake(self, resources: tuple[Resource, ...]) -> None:
        if "weights" in resources and self._loaded is not None:
            with self.gate.lock:
                move_model(self._loaded.model, self._device)
                if self._lora is not None:
                    self._lora.to(self._device)
                self._targets = None

    def _release(self) -> frozenset[Resource]:
        asleep: frozenset[Resource] = frozenset()
        with self.gate.lock:
            if self._offload_on_finish and self._loaded is not None:
                move_model(self._loaded.model, "cpu")
                if self._lora is not None:
                    self._lora.to("cpu")
                self._targets = None
                asleep = frozenset({"weights"})
            _release_device_memory(self._device)
        return asleep

    def _close(self) -> None:
        def drop_model() -> None:
            with self.gate.lock:
                self._loaded = None
                self._targets = None
                self._decode = None
            gc.collect()

        close_all(
            "HfGeneration",
            [
                ("the model", drop_model),
                ("device memory", lambda: _release_device_memory(self._device)),
            ],
        )

    # ---- weights: InProcessBackend runs the update through the gate; this writes them -------

    def _text_codec(self) -> TextCodec | None:
        return None if self._tokenizer is None else HfTokenizerCodec(self._tokenizer)

    def _weight_targets(self) -> Mapping[str, torch.Tensor]:
        if self._targets is None:  # the model's tensors by name, while they do not move
            self._targets = dict(self._model().model.state_dict())
            if self._lora is not None:  # an adapter's loads go to its staged copy
                self._targets.update(self._lora.staged)
        return self._targets

    def _commit_update(self, version: int) -> None:
        if self._lora is not None:
            with self.gate.lock:
                self._lora.commit()
        super()._commit_update(version)

    def _abort_update(self, written: bool) -> None:
        if self._lora is not None:
            with self.gate.lock:
                self._lora.discard()
        super()._abort_update(written)

    def _write_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        write_weights(self._weight_targets(), tensors)

    def _model(self) -> LoadedModel:
        if self._loaded is None:  # a guarded section checked the state; this is a shut-down race
            raise GenerationError("this HfGeneration is shut down; build a new one")
        return self._loaded


def _release_device_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _adapter(model: torch.nn.Module, config: Mapping[str, Any]) -> LoraAdapter | None:
    """The config's LoRA adapter on ``model``, or None without a ``lora`` section.

    Raises:
        GenerationConfigError: the section does not fit the model.
    """
    if not config.get("lora"):
        return None
    try:
        return LoraAdapter(model, config["lora"])
    except (ValueError, OSError, KeyError) as exc:
        raise GenerationConfigError(f"lora: {exc}") from exc
