"""``batch_invariant: true``: a backend's logprobs equal the trainer's exact forward, bitwise.

Not part of the default conformance suite: a backend that offers the capability runs this one on
a subject built with ``batch_invariant=True`` (and a test class per dtype). Every property
asserts ``torch.equal``, never a tolerance: a single bit of difference in any row fails it.
The trainer's side is ``gen_hf.exact.sequence_logprobs`` on a transformers model loaded
from the subject's ``model_name`` in the subject's dtype, fed batches of its own composition
(other rows beside, shuffled, padded left or right), so equality also proves independence from
batch mates, batch size, padding side and the backend's prefill/decode split.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import ClassVar

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gen_testkit.strategies import pad_prompts, prompts, score_batch
from gen_testkit.suite.base import ConformanceSubject, SuiteBase, property_settings

__all__ = ["BatchInvarianceProperties", "trainer_logprobs"]


def trainer_logprobs(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]], *, padding: str, mates: int = 0
) -> list[torch.Tensor]:
    """The trainer's exact logprobs of each sequence: float32 ``[len(sequence)]`` each.

    The sequences run in one batch with ``mates`` random sequences among them, in shuffled
    order, ``padding`` ("left" or "right").
    """
    from gen_hf.exact import sequence_logprobs

    rng = random.Random(len(sequences) * 1000 + mates)
    vocab = int(model.get_input_embeddings().num_embeddings)  # type: ignore[operator,union-attr]
    rows = [list(s) for s in sequences] + [
        [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))] for _ in range(mates)
    ]
    order = list(range(len(rows)))
    rng.shuffle(order)
    batch = pad_prompts([rows[i] for i in order], padding)  # type: ignore[arg-type]
    with torch.no_grad():
        logprobs = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"])
    out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
    for slot, i in enumerate(order):
        out[i] = logprobs[slot][batch["attention_mask"][slot].bool()]
    return out[: len(sequences)]


class BatchInvarianceProperties(SuiteBase):
    """Rollout and scored logprobs equal the trainer's exact forward of the same tokens."""

    #: The dtype the subject runs in (the trainer's model is loaded in the same one).
    dtype: ClassVar[str] = "float32"

    @pytest.fixture(scope="class")
    @classmethod
    def trainer_model(cls, subject: ConformanceSubject) -> Iterator[torch.nn.Module]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            subject.backend.config["model_name"], dtype=getattr(torch, cls.dtype)
        )
        yield model.eval()

    def test_subject_runs_batch_invariant(self, subject: ConformanceSubject):
        assert subject.backend.config["batch_invariant"] is True
        assert subject.backend.config["dtype"] == self.dtype
        assert subject.backend.capabilities.batch_invariant

    @property_settings
    @given(data=st.data())
    def test_generated_logprobs_equal_the_trainers_exact_forward(
        self, subject: ConformanceSubject, trainer_model: torch.nn.Module, data: st.DataObject
    ):
        drawn = self._draw(data, subject)
        out = subject.backend.generate(drawn.data, greedy=data.draw(st.booleans(), label="greedy"))
        sequences, generated = [], []
        for i, prompt in enumerate(drawn.prompts):
            end = int(out["unpadded_sequence_lengths"][i])
            sequences.append(out["output_ids"][i, :end].tolist())
            generated.append(range(len(prompt), end))
        expected = trainer_logprobs(
            trainer_model,
            sequences,
            padding=data.draw(st.sampled_from(["left", "right"]), label="trainer padding"),
            mates=data.draw(st.integers(0, 5), label="trainer batch mates"),
        )
        _assert_equal_rows(
            [out["logprobs"][i, list(positions)] for i, positions in enumerate(generated)],
            [expected[i][list(positions)] for i, positions in enumerate(generated)],
            "generate",
        )

    @property_settings
    @given(data=st.data())
    def test_scored_logprobs_equal_the_trainers_exact_forward(
        self, subject: ConformanceSubject, trainer_model: torch.nn.Module, data: st.DataObject
    ):
        if not self.claims_score:
            pytest.skip("the backend does not claim score")
        vocab = subject.vocab_size
        heads = data.draw(prompts(vocab, max_rows=self.max_rows), label="prompts")
        tails = data.draw(
            st.lists(
                prompts(vocab, min_rows=1, max_rows=1, max_length=10).map(lambda r: r[0]),
                min_size=len(heads),
                max_size=len(heads),
            ),
            label="responses",
        )
        sequences = [h + t for h, t in zip(heads, tails)]
        scored = subject.backend.score(score_batch(sequences, [len(h) for h in heads]))
        expected = trainer_logprobs(
            trainer_model,
            sequences,
            padding=data.draw(st.sampled_from(["left", "right"]), label="trainer padding"),
            mates=data.draw(st.integers(0, 5), label="trainer batch mates"),
        )
        _assert_equal_rows(
            [scored[i, len(h) : len(s)] for i, (h, s) in enumerate(zip(heads, sequences))],
            [expected[i][len(h) :] for i, (h, s) in enumerate(zip(heads, sequences))],
            "score",
        )


def _assert_equal_rows(
    actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], what: str
) -> None:
    """Every row bitwise equal; the message names each differing row and its largest gap."""
    differing = [
        f"row {i}: {int((a != e).sum())} of {a.numel()} differ, by up to "
        f"{float((a - e).abs().max()):.3g}"
        for i, (a, e) in enumerate(zip(actual, expected))
        if not torch.equal(a, e)
    ]
    assert not differing, f"{what} logprobs are not the trainer's exact forward: " + "; ".join(
        differing
    )
    assert sum(a.numel() for a in actual) > 0, "nothing was compared"
