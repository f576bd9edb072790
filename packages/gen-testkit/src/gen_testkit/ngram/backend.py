"""``NgramGeneration``: the whole generation interface on a deterministic n-gram model.

It needs no model files and runs in milliseconds, so the conformance suite is tested against it
and training loops can be unit-tested without a real model. It follows every CONTRACT rule with
the reference decoding step (``gen_backend_kit.sampling.select_next_tokens``), streams rows as
they finish and takes weight updates while rows run (``keep`` and ``abort``), stepping through
the same ``StepGate`` as gen-hf.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar, TypedDict, cast

import torch
from gen_backend_kit import GenerationCall, RowResult
from gen_backend_kit.decoding import StopRules
from gen_backend_kit.in_process import InProcessBackend
from gen_backend_kit.sampling import row_generators, select_next_tokens
from gen_backend_kit.scoring import ScoreBatch, ScoredRow, scored_row
from gen_backend_kit.stepping import GeneratedRows, RowControl
from gen_interface import BackendCapabilities, GenerationConfig, GenerationConfigError

from gen_testkit.ngram.model import NgramModel

__all__ = ["NgramConfig", "NgramGeneration", "NgramSettings"]


class NgramSettings(TypedDict, total=False):
    """The model: ``vocab_size`` (512), ``order`` (2), ``init_seed`` (0), ``context_limit``
    (256, the longest prompt + generation), and ``seconds_per_step`` (0.0): a pause before
    every decode step, so that a test's weight update lands while rows run, as it would on a
    real model."""

    vocab_size: int
    order: int
    init_seed: int
    context_limit: int
    seconds_per_step: float


class NgramConfig(GenerationConfig, total=False):
    """``GenerationConfig`` plus ``ngram`` (``NgramSettings``). ``model_name`` is a label."""

    ngram: NgramSettings


_NGRAM_DEFAULTS: NgramSettings = {
    "vocab_size": 512,
    "order": 2,
    "init_seed": 0,
    "context_limit": 256,
    "seconds_per_step": 0.0,
}


class NgramGeneration(InProcessBackend):
    """A pure-torch backend on ``NgramModel``, in process, on the CPU."""

    config_schema: ClassVar[type] = NgramConfig

    def __init__(self, config: NgramConfig):
        config = cast(NgramConfig, self.complete_config(config))
        settings: NgramSettings = {**_NGRAM_DEFAULTS, **config.get("ngram", {})}
        if config.get("stop_strings"):
            raise GenerationConfigError(
                "stop_strings needs a tokenizer and the ngram backend has none; use stop_token_ids"
            )
        self.model = NgramModel(settings["vocab_size"], settings["order"], settings["init_seed"])
        self._seconds_per_step = float(settings["seconds_per_step"])
        super().__init__(
            config,
            vocab_size=self.model.vocab_size,
            context_limit=int(settings["context_limit"]),
            has_tokenizer=False,
            model_specs=self.model.specs(),
        )

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            async_generation=True,
            in_flight_updates=True,
            token_streaming=True,
            weight_transports=frozenset({"shm", "state_dict"}),
            shares_process=True,
            devices=("cpu",),
            score=True,
            notes=("runs without a tokenizer: stop strings are refused",),
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the model's weights by name."""
        with self.gate.lock:
            return {name: w.clone() for name, w in self.model.weights.items()}

    # ---- generation --------------------------------------------------------------------------

    def _run_rows(self, call: GenerationCall, control: RowControl) -> Sequence[RowResult | None]:
        rules = StopRules.for_call(call.sampling, context_limit=self.context_limit)
        generators = row_generators([row.seed for row in call.sampling.rows])
        sequences = call.prompts.prompts()
        lengths = [len(s) for s in sequences]
        generated = GeneratedRows([row.top_logprobs for row in call.sampling.rows], control=control)
        results: list[RowResult | None] = [None] * len(sequences)

        def finish(i: int, reason: str, now: int) -> None:
            results[i] = control.finished(i, self._ended(generated, i, reason, now))

        mark = self.gate.enter()
        active = list(range(len(sequences)))
        while active and not control.cancelled.is_set():
            if self._seconds_per_step:
                time.sleep(self._seconds_per_step)
            with self.gate.step(mark) as ticket:
                if ticket.cut:
                    for i in active:
                        finish(i, "abort", ticket.version)
                    break
                try:
                    logits = self.model.next_logits([sequences[i] for i in active])
                except RuntimeError:  # the engine failed these rows
                    for i in active:
                        finish(i, "error", ticket.version)
                    break
            choice = select_next_tokens(
                logits,
                [call.sampling.rows[i] for i in active],
                processed=call.sampling.processed,
                generators=[generators[i] for i in active],
            )
            generated.record(active, choice, ticket.version)
            still = []
            for i in active:
                sequences[i].append(generated.tokens[i][-1])
                reason = rules.reason(i, lengths[i], generated.tokens[i])
                if reason is None:
                    still.append(i)
                else:
                    finish(i, reason, ticket.version)
            generated.publish()
            active = still
        return results

    def _ended(self, generated: GeneratedRows, row: int, reason: str, now: int) -> RowResult:
        """A finished row's result; an engine failure (``"error"``) raises."""
        return generated.ended(row, reason, now)

    def _score_rows(self, batch: ScoreBatch, top_logprobs: int) -> list[ScoredRow]:
        per_row = []
        with self.gate.step(self.gate.enter()):
            for sequence, prompt_length in zip(batch.sequences, batch.prompt_lengths):
                logits = self.model.sequence_logits(sequence[:-1])[prompt_length - 1 :]
                response = torch.tensor(sequence[prompt_length:], dtype=torch.int64)
                per_row.append(scored_row(logits.log_softmax(-1), response, top_logprobs))
        return per_row

    def _write_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self.model.weights[name].copy_(tensor)  # casts floating-point dtypes

    def _weight_targets(self) -> Mapping[str, torch.Tensor]:
        # written in place, and the base of deltas (the kit's CommittedWeights views them)
        return self.model.weights
