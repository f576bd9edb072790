"""``NgramGeneration``: the whole generation interface on a deterministic n-gram model.

It needs no model files and runs in milliseconds, so the conformance suite is tested against it
and training loops can be unit-tested without a real model. It follows every CONTRACT rule with
the reference decoding step (``gen_interface.sampling.select_next_tokens``).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from typing import Any, ClassVar, TypedDict, cast

import torch
from gen_interface import (
    BackendCapabilities,
    BatchedDataDict,
    GenerationConfig,
    GenerationConfigError,
    GenerationDatumSpec,
    GenerationInputError,
    GenerationInterface,
    GenerationOutputSpec,
    InFlight,
    RowResult,
    ScoreSpec,
    build_generation_output,
    normalize_generation_input,
    sampling_settings_of,
    validate_generation_config,
    with_per_call_overrides,
)
from gen_interface.decoding import StopRules
from gen_interface.lifecycle import Lifecycle, LifecycleView
from gen_interface.sampling import is_greedy, row_generators, row_seeds_for, select_next_tokens
from gen_interface.scoring import normalize_score_input, scatter_response_logprobs
from gen_interface.weights import (
    WeightUpdates,
    WeightUpdateSteps,
    check_weights_match,
    read_shared_weights,
    release_shared_weights,
)

from gen_testkit.ngram.model import NgramModel

__all__ = ["NgramConfig", "NgramGeneration", "NgramSettings"]


class NgramSettings(TypedDict, total=False):
    """The model: ``vocab_size`` (512), ``order`` (2), ``init_seed`` (0), ``context_limit``
    (256, the longest prompt + generation)."""

    vocab_size: int
    order: int
    init_seed: int
    context_limit: int


class NgramConfig(GenerationConfig, total=False):
    """``GenerationConfig`` plus ``ngram`` (``NgramSettings``). ``model_name`` is a label."""

    ngram: NgramSettings


_NGRAM_DEFAULTS: NgramSettings = {
    "vocab_size": 512,
    "order": 2,
    "init_seed": 0,
    "context_limit": 256,
}


class NgramGeneration(GenerationInterface):
    """A pure-torch backend on ``NgramModel``, in process, on the CPU."""

    config_schema: ClassVar[type] = NgramConfig

    def __init__(self, config: NgramConfig):
        validate_generation_config(config, schema=NgramConfig)
        settings: NgramSettings = {**_NGRAM_DEFAULTS, **config.get("ngram", {})}
        if config.get("stop_strings"):
            raise GenerationConfigError(
                "stop_strings needs a tokenizer and the ngram backend has none; use stop_token_ids"
            )
        self.config = config
        self.model = NgramModel(settings["vocab_size"], settings["order"], settings["init_seed"])
        self.context_limit = int(settings["context_limit"])
        self._lifecycle: Lifecycle | LifecycleView = Lifecycle("ngram backend")
        self._lock = threading.Lock()
        self._weights = WeightUpdates(
            self._lifecycle, self.model.specs(), (), WeightUpdateSteps(load=self._load)
        )

    def with_sampling(self, **overrides: Any) -> NgramGeneration:
        """Another front end on the same model with other ``PER_CALL_SETTINGS``; it shares the
        weights and the lifecycle, and shutting it down closes only the front end.

        Raises:
            GenerationConfigError: an override names another setting, or is out of range.
        """
        view = copy.copy(self)
        view.config = cast(GenerationConfig, with_per_call_overrides(self.config, overrides))
        view._lifecycle = self._lifecycle.view()
        return view

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            weight_transports=frozenset({"shm", "state_dict"}),
            devices=("cpu",),
            score=True,
            notes=("runs without a tokenizer: stop strings are refused",),
        )

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        prompts = normalize_generation_input(
            data,
            pad_token_id=self.config["pad_token_id"],
            vocab_size=self.model.vocab_size,
            context_limit=self.context_limit,
        )
        if any(prompts.stop_strings):
            raise GenerationInputError(
                "stop_strings need a tokenizer and the ngram backend has none; use stop_token_ids"
            )
        self._weights.admit(self.config.get("max_weight_staleness"))
        with self._lifecycle.generating(), self._lock:
            version = self._weights.version
            temperature, top_k, top_p = sampling_settings_of(self.config)
            greedy = is_greedy(temperature, greedy)
            rules = StopRules.for_call(self.config, prompts, context_limit=self.context_limit)
            generators = row_generators(row_seeds_for(prompts, self.config.get("seed")))
            sequences = prompts.prompts()
            lengths = [len(s) for s in sequences]
            generated: list[list[int]] = [[] for _ in sequences]
            logprobs: list[list[float]] = [[] for _ in sequences]
            truncated = [False] * len(sequences)
            active = list(range(len(sequences)))
            while active:
                tokens, chosen = select_next_tokens(
                    self.model.next_logits([sequences[i] for i in active]),
                    greedy=greedy,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    processed=self.config.get("logprobs_mode") == "processed",
                    generators=[generators[i] for i in active],
                )
                still = []
                for i, token, lp in zip(active, tokens.tolist(), chosen.tolist()):
                    sequences[i].append(token)
                    generated[i].append(token)
                    logprobs[i].append(lp)
                    reason = rules.reason(i, lengths[i], generated[i])
                    if reason is None:
                        still.append(i)
                    else:
                        truncated[i] = reason == "length"
                active = still
        rows = [
            RowResult(g, lp, t, weight_version=version)
            for g, lp, t in zip(generated, logprobs, truncated)
        ]
        return build_generation_output(prompts, rows, self.config["pad_token_id"])

    def score(self, data: BatchedDataDict[ScoreSpec]) -> torch.Tensor:
        batch = normalize_score_input(data, vocab_size=self.model.vocab_size)
        with self._lifecycle.generating(), self._lock:
            per_row = []
            for sequence, prompt_length in zip(batch.sequences, batch.prompt_lengths):
                logits = self.model.sequence_logits(sequence[:-1])[prompt_length - 1 :]
                response = torch.tensor(sequence[prompt_length:])
                per_row.append(logits.log_softmax(-1).gather(1, response[:, None]).squeeze(1))
        return scatter_response_logprobs(batch, per_row)

    def prepare_for_generation(
        self, *args: Any, tags: list[str] | None = None, **kwargs: Any
    ) -> None:
        self._lifecycle.prepare(tags)

    def finish_generation(self, *args: Any, **kwargs: Any) -> None:
        self._lifecycle.finish()

    def shutdown(self) -> None:
        self._lifecycle.shutdown()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the model's weights by name."""
        return {name: w.clone() for name, w in self.model.weights.items()}

    def prepare_refit_info(
        self, state_dict_info: Mapping[str, tuple[torch.Size, torch.dtype]]
    ) -> None:
        check_weights_match(state_dict_info, self.model.specs())

    @property
    def weight_version(self) -> int:
        return self._weights.version

    def start_weight_update(
        self, version: int | None = None, *, in_flight: InFlight = "keep"
    ) -> int:
        """Open a transaction; it waits for a running ``generate`` to end (no in-flight
        updates here), whatever ``in_flight`` says."""
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
        """Load every weight from an in-process state dict (checked like an IPC update)."""
        specs = {n: (t.shape, t.dtype) for n, t in state_dict.items()}
        self._weights.load_described(specs, lambda: self._write(state_dict))

    def _load(self, handles: Mapping[str, Any]) -> None:
        self._write(dict(read_shared_weights(handles)))

    def _write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        with self._lock:
            for name, tensor in tensors.items():
                self.model.weights[name].copy_(tensor)  # casts floating-point dtypes
