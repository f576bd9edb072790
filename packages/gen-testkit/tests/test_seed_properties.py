"""The two seed properties on a prompt whose distribution all but fixes its continuation: the
nightly profile drew ``[118, 498]`` on the n-gram backend in processed mode, where the config's
sampling (temperature 0.8, top-k 40, top-p 0.95) leaves one path, so the properties' old claim
(eight rows never all equal) was false for it. Stated over the whole distribution, they hold."""

from __future__ import annotations

from typing import Any

import pytest
from gen_testkit.conformance import conformance_config
from gen_testkit.ngram import NgramGeneration
from gen_testkit.strategies import pad_prompts
from gen_testkit.suite.base import ConformanceSubject
from gen_testkit.suite.determinism import DeterminismProperties

PROMPT = [118, 498]
VOCAB = 512  # test_ngram_conformance.py's subject


class _Drawn:
    """Stands in for hypothesis' ``data``: every draw is ``PROMPT`` (the one drawn batch)."""

    def draw(self, strategy: Any, label: str | None = None) -> list[list[int]]:
        return [PROMPT]


@pytest.fixture(scope="module")
def subject():
    """``TestNgramProcessed``'s subject."""
    config = conformance_config(
        backend="ngram", model_name="ngram", vocab_size=VOCAB, logprobs_mode="processed"
    )
    backend = NgramGeneration(config)
    yield ConformanceSubject(backend, VOCAB)
    backend.shutdown()


def test_the_config_sampling_gives_one_path_for_this_prompt(subject: ConformanceSubject):
    pad = subject.backend.config["pad_token_id"]
    out = subject.backend.generate(pad_prompts([PROMPT] * 8, "right", pad_token_id=pad))
    assert len({tuple(row.tolist()) for row in out["output_ids"]}) == 1


def test_both_seed_properties_hold_for_it(subject: ConformanceSubject):
    properties = DeterminismProperties()
    independent = DeterminismProperties.test_rows_sharing_a_prompt_sample_independently
    independent.hypothesis.inner_test(properties, subject, _Drawn())  # type: ignore[attr-defined]
    seeds = DeterminismProperties.test_sample_seeds_keep_all_64_bits
    for gap_bits in (31, 32, 48):
        seeds.hypothesis.inner_test(properties, subject, _Drawn(), 0, gap_bits)  # type: ignore[attr-defined]
