"""Determinism and independence: repeats, seeds, batch mates and padding layouts."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from gen_testkit.strategies import PADDINGS, pad_prompts, prompts
from gen_testkit.suite.base import ConformanceSubject, SuiteBase, property_settings

__all__ = ["DeterminismProperties"]


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
        """Eight copies of one prompt, sampled, do not all give the same continuation."""
        prompt = data.draw(prompts(subject.vocab_size, min_rows=1, max_rows=1), label="prompt")[0]
        batch = pad_prompts(
            [prompt] * 8, "right", pad_token_id=subject.backend.config["pad_token_id"]
        )
        output = subject.backend.generate(batch, greedy=False)
        rows = {tuple(row.tolist()) for row in output["output_ids"]}
        assert len(rows) > 1, f"8 sampled rows of prompt {prompt} are all identical: {rows}"

    @property_settings
    @given(data=st.data(), seed=st.integers(0, 2**62), gap_bits=st.sampled_from([31, 32, 48]))
    def test_sample_seeds_keep_all_64_bits(
        self, subject: ConformanceSubject, data: st.DataObject, seed: int, gap_bits: int
    ):
        """Per-row seeds that differ only in high bits (2^31, 2^32, 2^48 apart) sample
        differently, and each seed repeats its own sample: no seed bits are dropped."""
        prompt = data.draw(prompts(subject.vocab_size, min_rows=1, max_rows=1), label="prompt")[0]
        batch = pad_prompts(
            [prompt] * 8, "right", pad_token_id=subject.backend.config["pad_token_id"]
        )
        low = torch.arange(8, dtype=torch.int64) * 7919 + seed
        outputs = []
        for seeds in (low, low + (1 << gap_bits), low):
            batch["sample_seeds"] = seeds
            outputs.append(subject.backend.generate(batch, greedy=False))
        self._assert_same(subject, outputs[0], outputs[2], "the same sample_seeds twice")
        first = [tuple(row.tolist()) for row in outputs[0]["output_ids"]]
        moved = [tuple(row.tolist()) for row in outputs[1]["output_ids"]]
        assert first != moved, f"seeds 2^{gap_bits} apart gave identical samples on all 8 rows"

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
