"""The output layout: shapes, dtypes, padding, prompts, lengths, stop tokens, logprobs."""

from __future__ import annotations

from typing import Any

import torch
from gen_interface import BatchedDataDict
from hypothesis import given
from hypothesis import strategies as st

from gen_testkit.properties import (
    check_layout,
    check_lengths,
    check_logprob_range,
    check_padding,
    check_prompt_kept,
    check_stop_rules,
)
from gen_testkit.suite.base import ConformanceSubject, SuiteBase, property_settings

__all__ = ["LayoutProperties"]


class LayoutProperties(SuiteBase):
    """Every output follows the layout rules, on drawn batches."""

    # ---- the output layout ---------------------------------------------------------------

    @property_settings
    @given(data=st.data(), greedy=st.booleans())
    def test_output_layout(self, subject: ConformanceSubject, data: st.DataObject, greedy: bool):
        """Every field present, with its dtype and shape; L = max(p + g); unpadded = p + g."""
        drawn = self._draw(data, subject)
        check_layout(drawn.prompts, subject.backend.generate(drawn.data, greedy=greedy))

    @property_settings
    @given(data=st.data(), greedy=st.booleans())
    def test_prompt_kept(self, subject: ConformanceSubject, data: st.DataObject, greedy: bool):
        """Each output row starts with its unpadded prompt, whatever the input padding."""
        drawn = self._draw(data, subject)
        check_prompt_kept(drawn.prompts, subject.backend.generate(drawn.data, greedy=greedy))

    @property_settings
    @given(data=st.data(), greedy=st.booleans())
    def test_padding_and_zero_logprobs(
        self, subject: ConformanceSubject, data: st.DataObject, greedy: bool
    ):
        """pad_token_id after each row's end; logprobs 0.0 outside generated positions."""
        drawn = self._draw(data, subject)
        output = subject.backend.generate(drawn.data, greedy=greedy)
        check_padding(drawn.prompts, output, subject.backend.config["pad_token_id"])

    @property_settings
    @given(data=st.data(), greedy=st.booleans())
    def test_lengths_within_limits(
        self, subject: ConformanceSubject, data: st.DataObject, greedy: bool
    ):
        """Every row generates between 1 and max_new_tokens tokens."""
        drawn = self._draw(data, subject)
        output = subject.backend.generate(drawn.data, greedy=greedy)
        check_lengths(output, subject.backend.config["max_new_tokens"])

    @property_settings
    @given(data=st.data(), greedy=st.booleans())
    def test_stop_tokens(self, subject: ConformanceSubject, data: st.DataObject, greedy: bool):
        """A row ends right after its first stop token (kept), else runs to max_new_tokens."""
        drawn = self._draw(data, subject)
        config = subject.backend.config
        check_stop_rules(
            drawn.prompts,
            subject.backend.generate(drawn.data, greedy=greedy),
            config.get("stop_token_ids") or [],
            config["max_new_tokens"],
        )

    @property_settings
    @given(data=st.data(), greedy=st.booleans())
    def test_logprobs_in_range(
        self, subject: ConformanceSubject, data: st.DataObject, greedy: bool
    ):
        """Generated positions hold finite log-probabilities <= 0."""
        drawn = self._draw(data, subject)
        check_logprob_range(drawn.prompts, subject.backend.generate(drawn.data, greedy=greedy))

    def test_empty_batch(self, subject: ConformanceSubject):
        """B = 0 gives every output field, empty, with its dtype."""
        empty: BatchedDataDict[Any] = BatchedDataDict(
            input_ids=torch.zeros((0, 5), dtype=torch.int64),
            attention_mask=torch.zeros((0, 5), dtype=torch.int64),
        )
        for greedy in (True, False):
            output = subject.backend.generate(empty, greedy=greedy)
            check_layout([], output)
            assert output["output_ids"].shape[0] == 0
