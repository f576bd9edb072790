"""The parity checks fail when they should: one deliberate fault per candidate backend.

The checks are backend-agnostic, so they are exercised here on the testkit's n-gram backend,
whose exact logits are known; each faulty candidate differs from the reference in one place.
"""

from __future__ import annotations

import contextlib

import gen_testkit.ngram.backend as ngram_backend
import pytest
import torch
from gen_backend_kit.sampling import TokenChoice, processed_log_probs
from gen_testkit.ngram import NgramGeneration
from gen_testkit.parity import (
    NgramLogitsOracle,
    TimedBackend,
    parity_batches,
    run_pair,
    sampling_plan,
)
from gen_testkit.parity.workload import PARITY_SETTINGS
from gen_testkit.tolerances import tolerance_for

VOCAB = 512
CONFIG = {
    "backend": "ngram",
    "model_name": "ngram",
    "stop_token_ids": [2],
    "pad_token_id": 0,
    "dtype": "float32",
    "colocated": {"enabled": False},
    "stop_strings": None,
    **PARITY_SETTINGS,
}


@contextlib.contextmanager
def _replaced_sampling(processed):
    """Decode with ``processed`` in place of the reference processed distribution."""
    original = ngram_backend.select_next_tokens

    def select(logits, rows, *, processed: bool, generators):
        if all(row.greedy for row in rows):
            return original(logits, rows, processed=processed, generators=generators)
        filtered = torch.cat(
            [
                processed_fn(logits[i : i + 1], row.temperature, row.top_k, row.top_p)
                for i, row in enumerate(rows)
            ]
        )
        tokens = torch.stack(
            [
                torch.multinomial(filtered[i].exp(), 1, generator=g)[0]
                for i, g in enumerate(generators)
            ]
        )
        reported = filtered if processed else logits.float().log_softmax(-1)
        return TokenChoice(
            tokens,
            reported.gather(1, tokens[:, None]).squeeze(1),
            torch.zeros((len(rows), 0), dtype=torch.int64),
            torch.zeros((len(rows), 0)),
        )

    processed_fn = processed
    ngram_backend.select_next_tokens = select
    try:
        yield
    finally:
        ngram_backend.select_next_tokens = original


class TopPOnUnrenormalisedDistribution(NgramGeneration):
    """Top-p measured on the full tempered distribution, not the top-k-renormalised one."""

    def generate(self, data, greedy=False):
        def wrong(logits, temperature, top_k, top_p):
            scaled = logits.float() / temperature
            probs = scaled.softmax(-1)
            sorted_probs, order = probs.sort(-1, descending=True)
            keep_p = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
            keep = torch.zeros_like(keep_p).scatter(1, order, keep_p)
            if top_k:
                keep &= scaled >= scaled.topk(top_k, -1).values[:, -1:]
            return scaled.masked_fill(~keep, float("-inf")).log_softmax(-1)

        with _replaced_sampling(wrong):
            return super().generate(data, greedy)


class TemperatureIgnoredInProcessedLogprobs(NgramGeneration):
    """Samples correctly but reports processed logprobs computed at temperature 1."""

    def generate(self, data, greedy=False):
        out = super().generate(data, greedy)
        if greedy or not out.size:
            return out
        for i in range(out.size):
            end = int(out["unpadded_sequence_lengths"][i])
            start = end - int(out["generation_lengths"][i])
            sequence = out["output_ids"][i, :end].tolist()
            logits = self.model.sequence_logits(sequence[:-1])[start - 1 : end - 1]
            _, top_k, top_p = 0, self.config["top_k"], self.config["top_p"]
            wrong = processed_log_probs(logits, 1.0, top_k, top_p)
            tokens = torch.tensor(sequence[start:end])[:, None]
            out["logprobs"][i, start:end] = wrong.gather(1, tokens).squeeze(1)
        return out


class LogprobsOffByOne(NgramGeneration):
    """Reports each logprob one position late, in generate and in score alike."""

    def generate(self, data, greedy=False):
        out = super().generate(data, greedy)
        for i in range(out.size):
            end = int(out["unpadded_sequence_lengths"][i])
            start = end - int(out["generation_lengths"][i])
            values = out["logprobs"][i, start:end].clone()
            out["logprobs"][i, start:end] = torch.cat([values[:1], values[:-1]])
        return out

    def score(self, data):
        scores = super().score(data)
        shifted = scores.roll(1, dims=1)
        return torch.where(scores != 0, shifted, scores) if scores.numel() else scores


class OutputsInShardOrder(NgramGeneration):
    """Shards rows round-robin over two workers and concatenates the shards, unsorted."""

    def generate(self, data, greedy=False):
        out = super().generate(data, greedy)
        order = list(range(0, out.size, 2)) + list(range(1, out.size, 2))
        return out.select_indices(order)


class TopKListsOnePositionLate(NgramGeneration):
    """Teacher-forced top-k lists shifted one position late (``score`` itself is right)."""

    def score_top_logprobs(self, data, top_logprobs):
        out = super().score_top_logprobs(data, top_logprobs)
        for key in ("topk_ids", "topk_logprobs"):
            out[key] = out[key].roll(1, dims=1)
        return out


class TopKValuesAtAnotherTemperature(NgramGeneration):
    """Generated top-k lists whose logprobs are not the ones the chosen tokens report."""

    def generate(self, data, greedy=False):
        out = super().generate(data, greedy)
        out["topk_logprobs"] = out["topk_logprobs"] * 1.01
        return out


def _run(candidate_cls, settings=None):
    config = dict(CONFIG, **(settings or {}))
    reference = TimedBackend("ngram", NgramGeneration(config))
    candidate = TimedBackend("faulty", candidate_cls(config))
    return run_pair(
        reference,
        candidate,
        oracle=NgramLogitsOracle(reference.backend.model),
        batches=parity_batches(VOCAB),
        plan=sampling_plan(VOCAB, 600),
        tolerance=tolerance_for("float32", across_backends=True),
        dtype="float32",
    )


def test_a_faithful_candidate_passes():
    report = _run(NgramGeneration)
    assert report.ok, report.failures
    assert report.greedy.agree == report.rows and report.teacher_forced.max_abs == 0.0
    assert report.top_k.same == report.top_k.positions > 0 and report.top_k.chosen_checked > 0
    assert all(fit.p_value >= 1e-3 for fits in report.sampling.values() for fit in fits)


@pytest.mark.parametrize(
    ("fault", "caught_by"),
    [
        (LogprobsOffByOne, "teacher-forced"),
        (TopPOnUnrenormalisedDistribution, "do not fit the exact distribution"),
        (TemperatureIgnoredInProcessedLogprobs, "processed logprobs off the exact distribution"),
        (OutputsInShardOrder, "rows out of order"),
        (TopKListsOnePositionLate, "top-5 lists differ"),
        (TopKValuesAtAnotherTemperature, "have another logprob there"),
    ],
)
def test_each_fault_is_caught(fault, caught_by):
    report = _run(fault)
    assert not report.ok
    assert any(caught_by in failure for failure in report.failures), report.failures
