"""A suite that cannot fail proves nothing: run it against one broken backend per property.

``FAULTS`` maps each fault to the n-gram backend class that has it and the suite tests that must
catch it; every class differs from ``NgramGeneration`` in exactly one behaviour, or, for the
healing checks (``gen_testkit.suite.healing``), from the n-gram fleet ``NgramFleet``. The suite
runs against all of them in a separate pytest process, and each fault must fail its tests.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
from gen_backend_kit import GenerationCall
from gen_backend_kit.weights import CommittedWeights, read_shared_weights
from gen_interface import GenerationError, MixedWeightsError
from gen_interface.weights import apply_delta, bytes_checksum
from gen_testkit.ngram import NgramGeneration
from gen_testkit.ngram.fleet import NgramFleet
from gen_testkit.ngram.speculative import SpeculativeDecoder


class _OutputFault(NgramGeneration):
    """Applies ``corrupt`` to every non-empty output."""

    def generate(self, data, greedy=False):
        out = super().generate(data, greedy)
        return self.corrupt(out) if out.size else out

    def corrupt(self, out):
        raise NotImplementedError


class LogprobsInFloat64(_OutputFault):
    def corrupt(self, out):
        out["logprobs"] = out["logprobs"].double()
        return out


class PromptDropped(_OutputFault):
    def corrupt(self, out):
        out["output_ids"] = out["output_ids"].roll(-1, dims=1)
        return out


class PadsWithOne(_OutputFault):
    def corrupt(self, out):
        ids = out["output_ids"]
        past_end = torch.arange(ids.shape[1])[None, :] >= out["unpadded_sequence_lengths"][:, None]
        out["output_ids"] = torch.where(past_end, torch.ones_like(ids), ids)
        return out


class LogprobOnLastPromptToken(_OutputFault):
    def corrupt(self, out):
        start = out["unpadded_sequence_lengths"] - out["generation_lengths"]
        out["logprobs"][torch.arange(out.size), start - 1] = -0.5
        return out


class ReportsProbabilities(_OutputFault):
    def corrupt(self, out):
        out["logprobs"] = torch.where(out["logprobs"] != 0, out["logprobs"].exp(), out["logprobs"])
        return out


class RowsReversed(_OutputFault):
    def corrupt(self, out):
        return out.select_indices(list(reversed(range(out.size))))


class NoisyLogprobs(_OutputFault):
    """Logprobs jitter between calls, as a backend with a nondeterministic kernel would."""

    def corrupt(self, out):
        noise = torch.rand(out["logprobs"].shape) * 1e-3
        out["logprobs"] = torch.where(
            out["logprobs"] != 0, out["logprobs"] - noise, out["logprobs"]
        )
        return out


class _ConfigFault(NgramGeneration):
    """Decodes with ``changes`` applied to the config while reporting the original config."""

    changes: dict = {}

    def generate(self, data, greedy=False):
        reported = self.config
        self.config = {**reported, **self.changes}
        try:
            return super().generate(data, greedy)
        finally:
            self.config = reported


class OneTokenTooMany(_ConfigFault):
    def generate(self, data, greedy=False):
        self.changes = {"max_new_tokens": self.config["max_new_tokens"] + 1}
        return super().generate(data, greedy)


class IgnoresStopTokens(_ConfigFault):
    changes = {"stop_token_ids": []}


class TruncatedFlagInverted(_OutputFault):
    def corrupt(self, out):
        out["truncated"] = ~out["truncated"]
        return out


class UnseededSampling(NgramGeneration):
    """Samples from the global RNG, so a config seed does not repeat."""

    def generate(self, data, greedy=False):
        data = dict(data, sample_seeds=torch.randint(0, 2**31, (data["input_ids"].shape[0],)))
        if data["input_ids"].dim() != 2:
            data.pop("sample_seeds")
        return super().generate(data, greedy)


class SameSeedForEveryRow(NgramGeneration):
    def generate(self, data, greedy=False):
        if isinstance(data.get("input_ids"), torch.Tensor) and data["input_ids"].dim() == 2:
            data = dict(data, sample_seeds=torch.full((data["input_ids"].shape[0],), 7))
        return super().generate(data, greedy)


class SeedsCutTo31Bits(NgramGeneration):
    """Keeps only the low 31 bits of each caller seed, as a positive-int32 RNG API would."""

    def generate(self, data, greedy=False):
        seeds = data.get("sample_seeds") if isinstance(data, dict) else None
        if isinstance(seeds, torch.Tensor):
            data = dict(data, sample_seeds=seeds & (2**31 - 1))
        return super().generate(data, greedy)


class BatchMatesLeak(NgramGeneration):
    """Every row's context also sees the first token of row 0."""

    def generate(self, data, greedy=False):
        original = self.model.next_logits

        def leaky(contexts):
            logits = original(contexts)
            return (
                logits + 0.5 * self.model.weights["tables.1"][contexts[0][0]]
                if contexts
                else logits
            )

        self.model.next_logits = leaky
        try:
            return super().generate(data, greedy)
        finally:
            self.model.next_logits = original


class PaddingSideMatters(NgramGeneration):
    """Reads left padding as part of the prompt's context."""

    def generate(self, data, greedy=False):
        mask = data.get("attention_mask") if isinstance(data, dict) else None
        if (
            isinstance(mask, torch.Tensor)
            and mask.dim() == 2
            and mask.numel()
            and bool(mask[:, 0].eq(0).any())
        ):
            data = dict(data, input_ids=data["input_ids"] + 1)
        return super().generate(data, greedy)


class EmptyBatchCrashes(NgramGeneration):
    def generate(self, data, greedy=False):
        if data["input_ids"].shape[0] == 0:
            raise IndexError("empty batch")
        return super().generate(data, greedy)


class FinishIgnored(NgramGeneration):
    def finish_generation(self, *args, **kwargs):
        pass


class AcceptsOutOfVocabulary(NgramGeneration):
    def generate(self, data, greedy=False):
        if isinstance(data.get("input_ids"), torch.Tensor) and data["input_ids"].dim() == 2:
            data = dict(data, input_ids=data["input_ids"].clamp(max=self.model.vocab_size - 1))
        return super().generate(data, greedy)


class BrokenAfterBadInput(NgramGeneration):
    def generate(self, data, greedy=False):
        try:
            return super().generate(data, greedy)
        except GenerationError:
            self.model.weights["bias"][:100] += 2.0
            raise


class ScoreOffByOne(NgramGeneration):
    def score(self, data):
        return super().score(data).roll(1, dims=1)


class ProcessedModeIgnored(_ConfigFault):
    changes = {"logprobs_mode": "raw"}


class WeightUpdateIgnored(NgramGeneration):
    def update_weights_from_ipc_handles(self, handles):
        read_shared_weights(handles)


class PartialWriteOnMismatch(NgramGeneration):
    def update_weights_from_ipc_handles(self, handles):
        for name, tensor in read_shared_weights(handles):
            if name in self.model.weights and self.model.weights[name].shape == tensor.shape:
                self.model.weights[name].copy_(tensor.to(self.model.weights[name].dtype))
        super().update_weights_from_ipc_handles(handles)


class SegmentsLeft(NgramGeneration):
    def update_weights_from_ipc_handles(self, handles):
        with self.gate.lock:
            self._write_tensors(read_shared_weights(handles, expected=self.model.specs()))


class AbortResumesPausedRows(NgramGeneration):
    """An update dropped after some of it was written lets the rows it paused go on, on weights
    that are part old, part new (gen-vllm and gen-hf before the shared base)."""

    def _abort_update(self, written):
        self.gate.reopen(None)


class ProbeComparedAfterResuming(NgramGeneration):
    """Checks that its two replicas took the same weights by scoring a probe on each, compared
    exactly, after the rows resumed (gen-vllm before the shared base). A replica scoring the
    probe beside running rows differs in the last bits, as GPU kernels do with batch shape, so
    a healthy update while rows run breaks the backend."""

    running = 0

    def _run_rows(self, call, control):
        type(self).running += 1
        try:
            return super()._run_rows(call, control)
        finally:
            type(self).running -= 1

    def _commit_update(self, version):
        super()._commit_update(version)  # the rows resume
        probe = list(range(3, 35))
        logits = self.model.sequence_logits(probe[:-1]).log_softmax(-1)
        score = float(logits.gather(1, torch.tensor(probe[1:])[:, None]).sum())
        beside_rows = score * (1 + 1e-7 * self.running)  # the other replica's batch mates
        if score != beside_rows:
            raise MixedWeightsError("replicas give different logprobs for the probe")


class EngineErrorAsLength(NgramGeneration):
    """Reads a finish reason it does not know (an engine error) as a length cut-off (gen-vllm
    before the shared base)."""

    def _ended(self, generated, row, reason, now):
        known = reason if reason in ("stop", "length", "abort") else "length"
        return super()._ended(generated, row, known, now)


class DeltaOnAnyBase(NgramGeneration):
    """Applies a delta whatever base it names: each delta's base version and checksum are
    taken as its own before the transaction sees them (a receiver that trusts the trainer)."""

    def update_weights_from_ipc_handles(self, handles):
        handles = copy.deepcopy(dict(handles))
        for bucket in handles["buckets"]:
            for slot in bucket["tensors"]:
                if "delta" in slot:
                    slot["delta"]["base_version"] = self.weight_version
                    slot["delta"]["base_checksum"] = bytes_checksum(
                        self.model.weights[slot["name"]]
                    )
        super().update_weights_from_ipc_handles(handles)


class _UncheckedWeights(CommittedWeights):
    def apply(self, name, delta):
        made = dict(self.items())[name].clone()
        apply_delta(made, delta)
        return super().apply(name, dataclasses.replace(delta, checksum=bytes_checksum(made)))


class SkipsTheResultCheck(NgramGeneration):
    """Takes the tensor a delta makes as the trainer's, without checking its checksum."""

    def _committed_weights(self):
        committed = super()._committed_weights()
        if committed is not None:
            committed.__class__ = _UncheckedWeights
        return committed


class DroppedDeltasNotUndone(NgramGeneration):
    """Leaves the deltas of a dropped update in place (gen-hf and vLLM before deltas: weights
    part old, part new until a complete update commits)."""

    def _restore_weights(self):
        return False


class AsyncDropsARow(NgramGeneration):
    async def generate_async(self, data, greedy=False):
        async for i, row in super().generate_async(data, greedy):
            if i != 0:
                yield i, row
            await asyncio.sleep(0)


class RerunWithAnotherSeed(NgramFleet):
    """Re-runs a lost replica's rows with other seeds: a re-run row differs from the row the
    fault-free call returns."""

    def _share_call(self, call, rows, rerun):
        sub = super()._share_call(call, rows, rerun)
        if not rerun:
            return sub
        reseeded = [dataclasses.replace(row, seed=row.seed + 1) for row in sub.sampling.rows]
        return GenerationCall(sub.prompts, dataclasses.replace(sub.sampling, rows=tuple(reseeded)))


class AdmittedUnverified(NgramFleet):
    """Admits a replacement as soon as it is built: serving at the fleet's version, without
    taking the fleet's weights or checking them (it holds the checkpoint's)."""

    def _admit(self, index, replacement):
        self._install(index, replacement)


class RefitSkipsAReplica(NgramFleet):
    """Writes an update's loads to every member but the last, then commits it on all: one
    replica serves the old weights, reporting the new version."""

    def _loading_members(self):
        members = super()._loading_members()
        return members[:-1] if len(members) > 1 else members


class AcceptsDraftsUnverified(SpeculativeDecoder):
    """Takes every draft token without asking the target."""

    def _accepts(self, row, target_logits, p, draft_probs, j, token, generator):
        return True


class LogprobsFromTheDrafter(SpeculativeDecoder):
    """Verifies honestly, then reports each token with the drafter's logits."""

    def _reported_logits(self, target, contexts, drafts):
        return torch.stack(
            [
                self.drafter.next_logits([[*c, *d[:j]] for c, d in zip(contexts, drafts)])
                for j in range(self.k + 1)
            ],
            dim=1,
        )


class DraftsUnverified(NgramGeneration):
    _decoder = AcceptsDraftsUnverified


class DrafterLogprobs(NgramGeneration):
    _decoder = LogprobsFromTheDrafter


class BatchScheduleIgnored(NgramGeneration):
    """Proposes ``num_speculative_tokens`` drafts at every batch size, whatever the schedule."""

    def _draft_tokens(self, batch_size):
        return self.config["speculative"]["num_speculative_tokens"]


class DrafterRefitIgnored(NgramGeneration):
    """Takes a drafter update and commits it without writing the drafter."""

    def _commit_update(self, version):
        self._drafter_loaded = False
        super()._commit_update(version)


# fault -> (backend class, logprobs mode, the suite tests that must fail)
FAULTS: dict[str, tuple[type[NgramGeneration] | type[NgramFleet], str, set[str]]] = {
    "logprobs in float64": (LogprobsInFloat64, "raw", {"test_output_layout"}),
    "prompt dropped": (PromptDropped, "raw", {"test_prompt_kept"}),
    "pads with 1": (PadsWithOne, "raw", {"test_padding_and_zero_logprobs"}),
    "logprob on the prompt": (LogprobOnLastPromptToken, "raw", {"test_padding_and_zero_logprobs"}),
    "one token too many": (OneTokenTooMany, "raw", {"test_lengths_within_limits"}),
    "stop tokens ignored": (IgnoresStopTokens, "raw", {"test_stop_tokens"}),
    "truncated flag inverted": (TruncatedFlagInverted, "raw", {"test_stop_tokens"}),
    "probabilities for logprobs": (ReportsProbabilities, "raw", {"test_logprobs_in_range"}),
    "rows reversed": (RowsReversed, "raw", {"test_prompt_kept"}),
    "noisy logprobs": (NoisyLogprobs, "raw", {"test_greedy_repeatable"}),
    "unseeded sampling": (UnseededSampling, "raw", {"test_seeded_sampling_repeatable"}),
    "same seed for every row": (
        SameSeedForEveryRow,
        "raw",
        {"test_rows_sharing_a_prompt_sample_independently"},
    ),
    "seeds cut to 31 bits": (SeedsCutTo31Bits, "raw", {"test_sample_seeds_keep_all_64_bits"}),
    "batch mates leak": (BatchMatesLeak, "raw", {"test_row_independent_of_batch_mates"}),
    "padding side matters": (PaddingSideMatters, "raw", {"test_padding_layout_does_not_matter"}),
    "empty batch crashes": (EmptyBatchCrashes, "raw", {"test_empty_batch"}),
    "finish ignored": (FinishIgnored, "raw", {"test_finish_then_prepare_changes_nothing"}),
    "out-of-vocabulary accepted": (
        AcceptsOutOfVocabulary,
        "raw",
        {"test_bad_input_refused_and_backend_still_usable"},
    ),
    "broken after bad input": (
        BrokenAfterBadInput,
        "raw",
        {"test_bad_input_refused_and_backend_still_usable"},
    ),
    "score off by one": (ScoreOffByOne, "raw", {"test_score_matches_generated_logprobs"}),
    "processed mode ignored": (
        ProcessedModeIgnored,
        "processed",
        {"test_processed_logprobs_are_not_raw"},
    ),
    "weight update ignored": (
        WeightUpdateIgnored,
        "raw",
        {"test_weight_update_changes_outputs_and_restores"},
    ),
    "partial write on mismatch": (
        PartialWriteOnMismatch,
        "raw",
        {"test_mismatched_weight_update_refused"},
    ),
    "segments left behind": (
        SegmentsLeft,
        "raw",
        {"test_weight_update_changes_outputs_and_restores"},
    ),
    "async drops a row": (AsyncDropsARow, "raw", {"test_generate_async_yields_every_row"}),
    "abort resumes paused rows": (
        AbortResumesPausedRows,
        "raw",
        {"test_an_update_dropped_after_a_write_cuts_the_rows_it_paused"},
    ),
    "probe compared after resuming": (
        ProbeComparedAfterResuming,
        "raw",
        {"test_a_keep_update_midway_changes_the_later_tokens_and_versions_say_where"},
    ),
    "delta on any base": (
        DeltaOnAnyBase,
        "raw",
        {"test_a_bad_delta_is_refused_and_the_old_weights_stay"},
    ),
    "delta result unchecked": (
        SkipsTheResultCheck,
        "raw",
        {"test_a_bad_delta_is_refused_and_the_old_weights_stay"},
    ),
    "dropped deltas not undone": (
        DroppedDeltasNotUndone,
        "raw",
        {"test_a_bad_delta_is_refused_and_the_old_weights_stay"},
    ),
    "engine error read as length": (
        EngineErrorAsLength,
        "raw",
        {"test_a_row_the_engine_fails_is_an_error_never_a_length_cut_off"},
    ),
    "re-run row differs": (
        RerunWithAnotherSeed,
        "raw",
        {"test_a_call_that_loses_a_replica_returns_what_the_call_without_the_fault_returns"},
    ),
    "replacement admitted unverified": (
        AdmittedUnverified,
        "raw",
        {"test_a_replacement_serves_only_at_the_fleet_version_and_with_the_fleet_s_weights"},
    ),
    "replica serves a stale version": (
        RefitSkipsAReplica,
        "raw",
        {
            "test_a_healed_fleet_serves_at_the_fleet_version_and_the_next_refit_reaches_every_replica",
            "test_after_a_refit_no_replica_serves_an_older_version",
        },
    ),
    "drafter tokens accepted unverified": (
        DraftsUnverified,
        "raw",
        {
            "test_greedy_rows_equal_the_same_call_without_speculation",
            "test_sampled_tokens_follow_the_target_at_every_position",
        },
    ),
    "logprobs from the drafter": (
        DrafterLogprobs,
        "processed",
        {"test_reported_logprobs_are_the_targets"},
    ),
    "drafter refit ignored": (
        DrafterRefitIgnored,
        "raw",
        {"test_a_drafter_refit_changes_acceptance_and_never_the_outputs"},
    ),
    "batch schedule ignored": (
        BatchScheduleIgnored,
        "raw",
        {"test_the_batch_schedule_stops_drafts_where_it_gives_none"},
    ),
}

#: Faults of the speculative decoder, caught by the speculative properties.
SPECULATIVE_FAULTS = frozenset(
    {
        "drafter tokens accepted unverified",
        "logprobs from the drafter",
        "drafter refit ignored",
        "batch schedule ignored",
    }
)


HERE = Path(__file__).parent

_HEADER = """
import pytest
from test_suite_catches_faults import FAULTS
from test_ngram_conformance import ngram_subject
from gen_testkit.conformance import GenerationConformanceSuite
from gen_testkit.suite.in_flight import InFlightUpdateChecks
from test_ngram_fleet import ngram_fleet_subject
from gen_testkit.suite.healing import HealingChecks
from test_ngram_speculative import TestNgramSpeculative, speculative_subject
from gen_testkit.suite.speculative import one_row_only
"""

#: Only whether each test fails matters here, not its smallest failing example: skip shrinking.
_NO_SHRINKING = """
import pytest
from hypothesis import Phase, settings

@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    settings.register_profile(
        "faults",
        parent=settings.get_profile("ci"),
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
    )
    settings.load_profile("faults")
"""

_CLASS = """
class TestFault{index}(GenerationConformanceSuite, InFlightUpdateChecks):
    claims_weight_updates = True
    claims_weight_deltas = True
    claims_score = True

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls):
        backend_cls, mode, _ = FAULTS[{fault!r}]
        yield from ngram_subject(mode, backend_cls=backend_cls, in_flight=True)
"""

#: A fault of the fleet: the healing checks.
_HEALING_CLASS = """
class TestFault{index}(HealingChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls):
        backend_cls, _, _ = FAULTS[{fault!r}]
        yield from ngram_fleet_subject(backend_cls=backend_cls)

    @pytest.fixture(scope="class")
    @classmethod
    def replica_faults(cls, subject):
        return subject.backend
"""


#: A fault of the speculative decoder: the speculative properties.
_SPECULATIVE_CLASS = """
class TestFault{index}(TestNgramSpeculative):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls):
        backend_cls, mode, _ = FAULTS[{fault!r}]
        yield from speculative_subject(mode, backend_cls=backend_cls)

    @pytest.fixture(scope="class")
    @classmethod
    def scheduled_subject(cls):
        backend_cls, mode, _ = FAULTS[{fault!r}]
        schedule = one_row_only(3)
        yield from speculative_subject(
            mode, backend_cls=backend_cls, num_speculative_tokens_per_batch_size=schedule
        )
"""


def _test_class(index: int, fault: str) -> str:
    if fault in SPECULATIVE_FAULTS:
        return _SPECULATIVE_CLASS.format(index=index, fault=fault)
    template = _HEALING_CLASS if issubclass(FAULTS[fault][0], NgramFleet) else _CLASS
    return template.format(index=index, fault=fault)


def test_every_fault_fails_the_tests_that_guard_against_it(pytester):
    faults = sorted(FAULTS)
    pytester.makeconftest(_NO_SHRINKING)
    pytester.makepyfile(
        test_faults=_HEADER + "".join(_test_class(i, f) for i, f in enumerate(faults))
    )
    selection = " or ".join(
        f"(TestFault{i} and {name})" for i, fault in enumerate(faults) for name in FAULTS[fault][2]
    )
    junit = pytester.path / "report.xml"
    pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-k",
        selection,
        f"--junitxml={junit}",
        f"--rootdir={pytester.path}",
        "-o",
        f"pythonpath={HERE}",
    )
    failed: dict[str, set[str]] = {}
    passed: dict[str, set[str]] = {}
    for case in ET.parse(junit).iter("testcase"):
        index = int(case.get("classname").rsplit("TestFault", 1)[1])
        name = case.get("name").split("[")[0]
        bucket = (
            failed if case.find("failure") is not None or case.find("error") is not None else passed
        )
        bucket.setdefault(faults[index], set()).add(name)
    escaped = {
        fault: sorted(FAULTS[fault][2] - failed.get(fault, set()))
        for fault in faults
        if FAULTS[fault][2] - failed.get(fault, set())
    }
    assert not escaped, f"faults the conformance suite did not catch: {escaped}"
