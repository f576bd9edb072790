"""Determinism and independence: repeats, seeds, batch mates and padding layouts."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from gen_interface import BatchedDataDict
from hypothesis import given
from hypothesis import strategies as st

from gen_testkit.strategies import PADDINGS, pad_prompts, prompts
from gen_testkit.suite.base import ConformanceSubject, SuiteBase, property_settings

__all__ = ["DeterminismProperties"]

#: Identical samples as unlikely as this, under the model's own distribution, fail a property:
#: a correct backend fails it with at most this probability per example.
IMPLAUSIBLE = 1e-6


def _whole_distribution(batch: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
    """``batch`` with every row sampling from the model's whole distribution (per-row
    temperature 1, no top-k, top-p or min-p), so each row's reported logprobs, raw or
    processed, are the log-probabilities its tokens were drawn with."""
    rows = batch["input_ids"].shape[0]
    batch["temperature"] = torch.ones(rows, dtype=torch.float32)
    batch["top_p"] = torch.ones(rows, dtype=torch.float32)
    batch["min_p"] = torch.zeros(rows, dtype=torch.float32)
    batch["top_k"] = torch.full((rows,), -1, dtype=torch.int64)
    return batch


def _row_log_probability(output: Mapping[str, Any], row: int, prompt_length: int) -> float:
    """The log-probability of row ``row``'s whole continuation: the sum of its generated
    tokens' reported logprobs."""
    end = int(output["unpadded_sequence_lengths"][row])
    return float(output["logprobs"][row, prompt_length:end].double().sum())


class DeterminismProperties(SuiteBase):
    """A row's result depends on its prompt, its seed and the config alone."""

    # ---- determinism and independence ------------------------------------------------------

    @property_settings
    @given(data=st.data())
    def test_greedy_repeatable(self, subject: ConformanceSubject, data: st.DataObject):
        """The same greedy call twice gives the same output."""
        drawn = self._draw(data, subject)
        first = subject.backend.generate(drawn.data, greedy=True)
        second = subject.backend.generate(drawn.data, greedy=True)
        self._assert_same(subject, first, second, "two identical greedy calls")

    @property_settings
    @given(data=st.data())
    def test_seeded_sampling_repeatable(self, subject: ConformanceSubject, data: st.DataObject):
        """With a config seed, the same sampled call twice gives the same output."""
        drawn = self._draw(data, subject)
        first = subject.backend.generate(drawn.data, greedy=False)
        second = subject.backend.generate(drawn.data, greedy=False)
        self._assert_same(subject, first, second, "two identical seeded sampling calls")

    @property_settings
    @given(data=st.data())
    def test_rows_sharing_a_prompt_sample_independently(
        self, subject: ConformanceSubject, data: st.DataObject
    ):
        """Eight copies of one prompt, sampled from the model's whole distribution with the
        config's seed, give the same continuation no more often than that distribution allows.

        Eight independent draws all equal one continuation of probability p with probability
        p^8; rows that do so with p^7 < ``IMPLAUSIBLE`` fail (p from the rows' own logprobs).
        A prompt whose distribution all but fixes its continuation may give eight equal rows.
        """
        prompt = data.draw(prompts(subject.vocab_size, min_rows=1, max_rows=1), label="prompt")[0]
        batch = _whole_distribution(
            pad_prompts([prompt] * 8, "right", pad_token_id=subject.backend.config["pad_token_id"])
        )
        output = subject.backend.generate(batch, greedy=False)
        rows = {tuple(row.tolist()) for row in output["output_ids"]}
        if len(rows) > 1:
            return
        log_p = _row_log_probability(output, 0, len(prompt))
        assert 7 * log_p >= math.log(IMPLAUSIBLE), (
            f"8 sampled rows of prompt {prompt} are all identical ({rows}), though their "
            f"continuation has probability {math.exp(log_p):.3g} under the rows' own logprobs "
            f"(8 equal draws: p^7 = {math.exp(7 * log_p):.3g} < {IMPLAUSIBLE:g})"
        )

    @property_settings
    @given(data=st.data(), seed=st.integers(0, 2**62), gap_bits=st.sampled_from([31, 32, 48]))
    def test_sample_seeds_keep_all_64_bits(
        self, subject: ConformanceSubject, data: st.DataObject, seed: int, gap_bits: int
    ):
        """Per-row seeds that differ only in high bits (2^31, 2^32, 2^48 apart) sample
        differently, and each seed repeats its own sample: no seed bits are dropped.

        Eight rows of one prompt, sampled from the model's whole distribution, each with its
        own seed, then with each seed moved by 2^gap_bits: row i repeats its continuation (of
        probability p_i) by chance with probability p_i^2, so all eight together with
        probability prod(p_i^2). Moved seeds that repeat all eight rows with prod(p_i) <
        ``IMPLAUSIBLE`` fail (p_i from the rows' own logprobs); rows whose distribution all
        but fixes them may repeat.
        """
        prompt = data.draw(prompts(subject.vocab_size, min_rows=1, max_rows=1), label="prompt")[0]
        batch = _whole_distribution(
            pad_prompts([prompt] * 8, "right", pad_token_id=subject.backend.config["pad_token_id"])
        )
        low = torch.arange(8, dtype=torch.int64) * 7919 + seed
        outputs = []
        for seeds in (low, low + (1 << gap_bits), low):
            batch["sample_seeds"] = seeds
            outputs.append(subject.backend.generate(batch, greedy=False))
        self._assert_same(subject, outputs[0], outputs[2], "the same sample_seeds twice")
        first = [tuple(row.tolist()) for row in outputs[0]["output_ids"]]
        moved = [tuple(row.tolist()) for row in outputs[1]["output_ids"]]
        if first != moved:
            return
        log_p = sum(_row_log_probability(outputs[0], i, len(prompt)) for i in range(8))
        assert log_p >= math.log(IMPLAUSIBLE), (
            f"seeds 2^{gap_bits} apart gave identical samples on all 8 rows, though repeating "
            f"them by chance has probability {math.exp(2 * log_p):.3g} under the rows' own "
            f"logprobs (prod p_i = {math.exp(log_p):.3g} < {IMPLAUSIBLE:g})"
        )

    @property_settings
    @given(data=st.data(), greedy=st.booleans())
    def test_row_independent_of_batch_mates(
        self, subject: ConformanceSubject, data: st.DataObject, greedy: bool
    ):
        """Row i's output does not change when the other rows of its batch change."""
        drawn = self._draw(data, subject, min_rows=2)
        i = data.draw(st.integers(0, len(drawn.prompts) - 1), label="row")
        others = data.draw(
            prompts(subject.vocab_size, min_rows=len(drawn.prompts), max_rows=len(drawn.prompts)),
            label="other rows",
        )
        mates = [drawn.prompts[i] if j == i else others[j] for j in range(len(others))]
        pad = subject.backend.config["pad_token_id"]
        first = subject.backend.generate(drawn.data, greedy=greedy).select_indices([i])
        second = subject.backend.generate(
            pad_prompts(mates, "left", pad_token_id=pad), greedy=greedy
        )
        self._assert_same(subject, first, second.select_indices([i]), f"row {i} with new mates")
        if greedy:
            alone = subject.backend.generate(
                pad_prompts([drawn.prompts[i]], "right", pad_token_id=pad), greedy=True
            )
            self._assert_same(subject, first, alone, f"row {i} alone")

    @property_settings
    @given(data=st.data(), greedy=st.booleans())
    def test_padding_layout_does_not_matter(
        self, subject: ConformanceSubject, data: st.DataObject, greedy: bool
    ):
        """Left, right, mixed padding and input_lengths give the same output."""
        rows = data.draw(
            prompts(subject.vocab_size, max_rows=self.max_rows, max_length=self.max_prompt_length),
            label="prompts",
        )
        pad = subject.backend.config["pad_token_id"]
        offsets = data.draw(st.lists(st.integers(0, 3), min_size=len(rows), max_size=len(rows)))
        outputs = {
            padding: subject.backend.generate(
                pad_prompts(rows, padding, pad_token_id=pad, offsets=offsets), greedy=greedy
            )
            for padding in PADDINGS
        }
        for padding in PADDINGS[1:]:
            self._assert_same(subject, outputs["left"], outputs[padding], f"{padding} vs left")

    def test_a_batch_beyond_the_per_step_budget_gives_each_row_what_it_gives_alone(
        self, subject: ConformanceSubject
    ):
        """A sampled, seeded batch with more prompt tokens than an engine schedules in one step
        (``large_batch_tokens``): every row equals that row generated alone, and the backend
        keeps serving."""
        pad = subject.backend.config["pad_token_id"]
        rows, length = self.large_batch_rows, self.large_batch_tokens // self.large_batch_rows
        generator = torch.Generator().manual_seed(17)
        prompts_ = [  # mixed lengths, within 3% of the budget
            torch.randint(3, subject.vocab_size, (length - i % 4,), generator=generator).tolist()
            for i in range(rows)
        ]
        seeds = torch.arange(1000, 1000 + rows)
        batch = pad_prompts(prompts_, "left", pad_token_id=pad)
        batch["sample_seeds"] = seeds
        whole = subject.backend.generate(batch, greedy=False)
        for i, prompt in enumerate(prompts_):
            alone = pad_prompts([prompt], "right", pad_token_id=pad)
            alone["sample_seeds"] = seeds[i : i + 1]
            self._assert_same(
                subject,
                whole.select_indices([i]),
                subject.backend.generate(alone, greedy=False),
                f"row {i} of {rows} ({sum(map(len, prompts_))} prompt tokens) vs alone",
            )
