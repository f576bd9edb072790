"""``NgramGeneration``: the whole generation interface on a deterministic n-gram model.

It needs no model files and runs in milliseconds, so the conformance suite is tested against it
and training loops can be unit-tested without a real model. It follows every CONTRACT rule with
the reference decoding step (``gen_backend_kit.sampling.select_next_tokens``), streams rows as
they finish and takes weight updates while rows run (``keep`` and ``abort``), stepping through
the same ``StepGate`` as gen-hf.

With ``speculative`` (method ``"draft_model"``; ``model`` is a label, as ``model_name`` is) it
is the reference speculative decoder (``gen_testkit.ngram.speculative``): the drafter is an
n-gram model of order ``ngram.draft_order`` drawn from the target's seed, so it starts equal to
the target's lower-order part. Its weights are a group of their own, ``drafter.bias`` and
``drafter.tables.<k>``: an update carries the target's, the drafter's, or both, each whole, and
the drafter's are staged until the commit.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar, TypedDict, cast

import torch
from gen_backend_kit import GenerationCall, RowResult
from gen_backend_kit.decoding import StopRules
from gen_backend_kit.in_process import InProcessBackend
from gen_backend_kit.sampling import TokenChoice, row_generators, select_next_tokens
from gen_backend_kit.scoring import ScoreBatch, ScoredRow, scored_row
from gen_backend_kit.speculation import (
    DEFAULT_MIN_ACCEPTANCE_RATE,
    SpeculationCounts,
    draft_tokens_at,
)
from gen_backend_kit.stepping import GeneratedRows, RowControl
from gen_interface import BackendCapabilities, GenerationConfig, GenerationConfigError

from gen_testkit.ngram.model import NgramModel
from gen_testkit.ngram.speculative import SpeculativeDecoder

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
    draft_order: int  # the drafter's order under ``speculative`` (1)


class NgramConfig(GenerationConfig, total=False):
    """``GenerationConfig`` plus ``ngram`` (``NgramSettings``). ``model_name`` is a label."""

    ngram: NgramSettings


_NGRAM_DEFAULTS: NgramSettings = {
    "vocab_size": 512,
    "order": 2,
    "init_seed": 0,
    "context_limit": 256,
    "seconds_per_step": 0.0,
    "draft_order": 1,
}

#: The prefix of the drafter's weight names.
DRAFTER = "drafter."


class NgramGeneration(InProcessBackend):
    """A pure-torch backend on ``NgramModel``, in process, on the CPU."""

    config_schema: ClassVar[type] = NgramConfig
    speculative_methods: ClassVar[frozenset[str]] = frozenset({"draft_model"})

    def __init__(self, config: NgramConfig):
        config = cast(NgramConfig, self.complete_config(config))
        settings: NgramSettings = {**_NGRAM_DEFAULTS, **config.get("ngram", {})}
        if config.get("stop_strings"):
            raise GenerationConfigError(
                "stop_strings needs a tokenizer and the ngram backend has none; use stop_token_ids"
            )
        self.model = NgramModel(settings["vocab_size"], settings["order"], settings["init_seed"])
        self._seconds_per_step = float(settings["seconds_per_step"])
        self.speculation: SpeculativeDecoder | None = None
        self.drafter_version = 0
        self._counts = SpeculationCounts()
        self._staged: dict[str, torch.Tensor] = {}
        self._drafter_loaded = False
        specs = self.model.specs()
        speculative = config.get("speculative")
        if speculative:
            drafter = NgramModel(
                settings["vocab_size"], settings["draft_order"], settings["init_seed"]
            )
            self.speculation = self._decoder(
                self.model,
                drafter,
                speculative["num_speculative_tokens"],
                draw_drafts=speculative.get("draft_sample_method", "probabilistic")
                == "probabilistic",
            )
            self._staged = {DRAFTER + n: w.clone() for n, w in drafter.weights.items()}
            self._counts.watch_acceptance(
                speculative.get("min_acceptance_rate", DEFAULT_MIN_ACCEPTANCE_RATE),
                "NgramGeneration (draft_model)",
            )
            specs.update({n: (w.shape, w.dtype) for n, w in self._staged.items()})
        super().__init__(
            config,
            vocab_size=self.model.vocab_size,
            context_limit=int(settings["context_limit"]),
            has_tokenizer=False,
            model_specs=specs,
            staged_weights=self._staged.keys(),
        )
        self._targets = (
            {**self.model.weights, **self._staged} if self._staged else self.model.weights
        )

    #: The speculative decoder class (the fault suite plants faults in subclasses of it).
    _decoder: ClassVar[type[SpeculativeDecoder]] = SpeculativeDecoder

    def _draft_tokens(self, batch_size: int) -> int:
        """Draft tokens of a verifying step of ``batch_size`` rows (the batch schedule's)."""
        section = self.config.get("speculative")
        assert section, "only a speculating backend drafts"
        return draft_tokens_at(section, batch_size)

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
            speculative=self.speculative_methods,
            notes=("runs without a tokenizer: stop strings are refused",),
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the model's weights by name (the drafter's too, under ``speculative``)."""
        with self.gate.lock:
            weights = {name: w.clone() for name, w in self.model.weights.items()}
            if self.speculation is not None:
                drafter = self.speculation.drafter.weights
                weights.update({DRAFTER + n: w.clone() for n, w in drafter.items()})
            return weights

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
            rows = [call.sampling.rows[i] for i in active]
            with self.gate.step(mark) as ticket:
                if ticket.cut:
                    for i in active:
                        finish(i, "abort", ticket.version)
                    break
                try:
                    if self.speculation is None:
                        logits = self.model.next_logits([sequences[i] for i in active])
                    else:
                        step = self.speculation.step(
                            [sequences[i] for i in active],
                            rows,
                            processed=call.sampling.processed,
                            generators=[generators[i] for i in active],
                            k=self._draft_tokens(len(active)),
                        )
                except RuntimeError:  # the engine failed these rows
                    for i in active:
                        finish(i, "error", ticket.version)
                    break
            if self.speculation is None:
                choice = select_next_tokens(
                    logits,
                    rows,
                    processed=call.sampling.processed,
                    generators=[generators[i] for i in active],
                )
                emitted = [(list(range(len(active))), choice)]
            else:
                self._counts.add(
                    drafts=len(active) if step.proposed else 0,
                    proposed=step.proposed * len(active),
                    accepted=sum(step.accepted),
                )
                emitted = step.emitted
            running = dict.fromkeys(active)
            for at, choice in emitted:  # position by position: a stop ends the row there
                keep = [slot for slot, a in enumerate(at) if active[a] in running]
                if not keep:
                    break
                index = torch.tensor(keep)
                generated.record(
                    [active[at[slot]] for slot in keep],
                    TokenChoice(*(part[index] for part in choice)),
                    ticket.version,
                )
                for slot in keep:
                    i = active[at[slot]]
                    sequences[i].append(generated.tokens[i][-1])
                    reason = rules.reason(i, lengths[i], generated.tokens[i])
                    if reason is not None:
                        del running[i]
                        finish(i, reason, ticket.version)
                generated.publish()
            active = list(running)
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
            if name.startswith(DRAFTER):  # staged until the commit
                self._staged[name].copy_(tensor)
                self._drafter_loaded = True
            else:
                self.model.weights[name].copy_(tensor)  # casts floating-point dtypes

    def _weight_targets(self) -> Mapping[str, torch.Tensor]:
        # written in place, and the base of deltas (the kit's CommittedWeights views them)
        return self._targets

    def _commit_update(self, version: int) -> None:
        if self._drafter_loaded and self.speculation is not None:
            with self.gate.lock:
                for name, weight in self.speculation.drafter.weights.items():
                    weight.copy_(self._staged[DRAFTER + name])
                self.drafter_version = version
                self._drafter_loaded = False
        super()._commit_update(version)

    def _abort_update(self, written: bool) -> None:
        if self._drafter_loaded and self.speculation is not None:
            with self.gate.lock:
                for name, weight in self.speculation.drafter.weights.items():
                    self._staged[DRAFTER + name].copy_(weight)
                self._drafter_loaded = False
        super()._abort_update(written)

    def _extra_metrics(self, clear: bool = False) -> dict[str, int | float]:
        if clear:
            self._counts.clear()
            return {}
        metrics = self._counts.metrics()
        if self.speculation is not None:
            metrics["speculative_drafter_weight_version"] = self.drafter_version
        return metrics
