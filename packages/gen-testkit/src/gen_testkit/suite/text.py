"""Text in, text out (``generate_text``): the same as ``generate`` on the tokenised prompts."""

from __future__ import annotations

from typing import Any

import pytest
from gen_interface import GenerationError, GenerationInputError

from gen_testkit.strategies import pad_prompts
from gen_testkit.suite.base import ConformanceSubject, SuiteBase

__all__ = ["TextProperties"]

PROMPTS = ["hello world", "the quick brown fox", "a", "one two three four five six"]


class TextProperties(SuiteBase):
    """NeMo RL's ``generate_text`` on a backend with a tokenizer; a clear refusal without one."""

    def test_generate_text_is_generate_on_the_tokenised_prompts_decoded(
        self, subject: ConformanceSubject
    ):
        backend = subject.backend
        if not backend.capabilities.stop_strings:  # stop strings and text need a tokenizer
            with pytest.raises(GenerationError, match="needs a tokenizer"):
                backend.generate_text({"prompts": PROMPTS})
            return
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(backend.config["model_name"])
        ids = [tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
        batch = pad_prompts(ids, "lengths", pad_token_id=backend.config["pad_token_id"])
        reference = backend.generate(batch, greedy=True)
        expected = [
            tokenizer.decode(
                reference["output_ids"][
                    i, len(row) : int(reference["unpadded_sequence_lengths"][i])
                ].tolist(),
                skip_special_tokens=True,
            )
            for i, row in enumerate(ids)
        ]
        out = backend.generate_text({"prompts": PROMPTS}, greedy=True)
        assert out["texts"] == expected
        assert any(expected), "every row generated nothing: the check would prove little"

    def test_generate_text_refuses_what_is_not_a_list_of_prompts(self, subject: ConformanceSubject):
        backend = subject.backend
        if not backend.capabilities.stop_strings:
            pytest.skip("the backend has no tokenizer (the refusal is checked above)")
        bad_inputs: list[dict[str, Any]] = [
            {},
            {"prompts": "one string"},
            {"prompts": []},
            {"prompts": ["ok", 3]},
        ]
        for bad in bad_inputs:
            with pytest.raises(GenerationInputError, match="generate_text"):
                backend.generate_text(bad)
        assert len(backend.generate_text({"prompts": PROMPTS[:1]}, greedy=True)["texts"]) == 1
