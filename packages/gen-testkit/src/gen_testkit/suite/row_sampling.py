"""Per-row sampling settings and top-k logprobs, on any backend.

A batch whose rows carry their own settings gives each row exactly what a batch of that row
alone gives with those settings in the config (a ``with_sampling`` front end); the top-k fields
follow the chosen tokens' logprobs; ``score_top_logprobs`` gives the top-k generation reported.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gen_interface import BatchedDataDict
from hypothesis import given
from hypothesis import strategies as st

from gen_testkit.strategies import pad_prompts
from gen_testkit.suite.base import ConformanceSubject, SuiteBase, property_settings
from gen_testkit.tolerances import tolerance_for

__all__ = ["RowSamplingProperties"]

_TEMPERATURES = [0.0, 0.5, 0.8, 1.3]
_TOP_KS = [-1, 1, 5, 40]
_TOP_PS = [1.0, 0.95, 0.5]
_MIN_PS = [0.0, 0.05, 0.3]
_TOP_LOGPROBS = [0, 1, 3]


def _row_settings(vocab_size: int, max_new_tokens: int) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "max_new_tokens": st.integers(1, max_new_tokens),
            "temperature": st.sampled_from(_TEMPERATURES),
            "top_k": st.sampled_from(_TOP_KS),
            "top_p": st.sampled_from(_TOP_PS),
            "min_p": st.sampled_from(_MIN_PS),
            "top_logprobs": st.sampled_from(_TOP_LOGPROBS),
            "stop_token_ids": st.none()
            | st.lists(st.integers(3, vocab_size - 1), max_size=20, unique=True),
            "sample_seeds": st.integers(0, 2**63 - 1),
        }
    )


def _with_rows(batch: BatchedDataDict[Any], rows: list[dict[str, Any]]) -> BatchedDataDict[Any]:
    """``batch`` with every row's settings as per-row entries."""
    batch = BatchedDataDict(dict(batch))
    for key in ("max_new_tokens", "top_k", "top_logprobs", "sample_seeds"):
        batch[key] = torch.tensor([r[key] for r in rows], dtype=torch.int64)
    for key in ("temperature", "top_p", "min_p"):
        batch[key] = torch.tensor([r[key] for r in rows], dtype=torch.float32)
    batch["stop_token_ids"] = [r["stop_token_ids"] for r in rows]
    return batch


class RowSamplingProperties(SuiteBase):
    """Per-row settings and top-k logprobs."""

    @property_settings
    @given(data=st.data())
    def test_rows_with_their_own_settings_get_what_they_get_alone(
        self, subject: ConformanceSubject, data: st.DataObject
    ):
        """Mixed per-row max_new_tokens, temperature, top-k, top-p, min-p, stop ids, seeds and
        top logprobs in one batch: each row equals that row alone, its settings in the config."""
        backend, pad = subject.backend, subject.backend.config["pad_token_id"]
        drawn = self._draw(data, subject)
        limit = int(backend.config["max_new_tokens"])
        rows = data.draw(
            st.lists(
                _row_settings(subject.vocab_size, limit),
                min_size=len(drawn.prompts),
                max_size=len(drawn.prompts),
            ),
            label="settings",
        )
        mixed = backend.generate(_with_rows(drawn.data, rows), greedy=False)
        for i, (prompt, row) in enumerate(zip(drawn.prompts, rows)):
            settings = {k: v for k, v in row.items() if k != "sample_seeds"}
            if settings["stop_token_ids"] is None:
                del settings["stop_token_ids"]
            alone = pad_prompts([prompt], "right", pad_token_id=pad)
            alone["sample_seeds"] = torch.tensor([row["sample_seeds"]])
            expected = backend.with_sampling(**settings).generate(alone, greedy=False)
            got = mixed.select_indices([i])
            self._assert_same(subject, expected, got, f"row {i} with {settings} vs alone")
            _assert_top_same(subject, expected, got, i, row["top_logprobs"])

    @property_settings
    @given(data=st.data(), greedy=st.booleans())
    def test_top_logprobs_are_ranked_and_hold_the_chosen_token(
        self, subject: ConformanceSubject, data: st.DataObject, greedy: bool
    ):
        """Each generated position lists k distinct tokens, most likely first, in the logprobs
        mode; the chosen token's logprob equals its entry whenever it is among them (and greedy
        tokens are the first, up to near-ties); nothing outside the generated positions."""
        drawn = self._draw(data, subject)
        count = len(drawn.prompts)
        ks = data.draw(
            st.lists(st.sampled_from(_TOP_LOGPROBS), min_size=count, max_size=count),
            label="top_logprobs",
        )
        batch: BatchedDataDict[Any] = BatchedDataDict(dict(drawn.data))
        batch["top_logprobs"] = torch.tensor(ks, dtype=torch.int64)
        out = subject.backend.generate(batch, greedy=greedy)
        _check_top_logprobs(subject, drawn.prompts, ks, out, greedy)

    @property_settings
    @given(data=st.data())
    def test_score_top_logprobs_give_the_top_logprobs_generation_reported(
        self, subject: ConformanceSubject, data: st.DataObject
    ):
        """Teacher forcing the generated rows gives the top-k greedy generation reported (raw)."""
        if not self.claims_score:
            pytest.skip("backend does not claim score")
        drawn = self._draw(data, subject)
        batch: BatchedDataDict[Any] = BatchedDataDict(dict(drawn.data))
        batch["top_logprobs"] = torch.full((len(drawn.prompts),), 3, dtype=torch.int64)
        out = subject.backend.generate(batch, greedy=True)
        scored = subject.backend.score_top_logprobs(
            BatchedDataDict(
                input_ids=out["output_ids"],
                prompt_lengths=torch.tensor([len(p) for p in drawn.prompts]),
                unpadded_sequence_lengths=out["unpadded_sequence_lengths"],
            ),
            3,
        )
        tolerance = tolerance_for(
            subject.backend.config.get("dtype", "float32"), across_backends=False
        )
        for key in ("logprobs", "topk_logprobs"):
            gap = (scored[key] - out[key]).abs().max() if out[key].numel() else torch.tensor(0.0)
            assert float(gap) <= tolerance.logprob_atol, f"score's {key} differ by {float(gap):.3g}"
        _assert_ids_agree(scored, out, tolerance.near_tie, "score vs generate")


def _check_top_logprobs(
    subject: ConformanceSubject,
    prompts: list[list[int]],
    ks: list[int],
    out: BatchedDataDict[Any],
    greedy: bool,
) -> None:
    ids, values = out["topk_ids"], out["topk_logprobs"]
    assert ids.shape[2] == max(ks, default=0), f"K is {ids.shape[2]}, rows asked {ks}"
    near = tolerance_for(
        subject.backend.config.get("dtype", "float32"), across_backends=False
    ).near_tie
    for i, (prompt, k) in enumerate(zip(prompts, ks)):
        start, g = len(prompt), int(out["generation_lengths"][i])
        inside = torch.zeros(ids.shape[1], dtype=torch.bool)
        inside[start : start + g] = True
        assert bool((ids[i, ~inside] == -1).all()) and bool((values[i, ~inside] == 0).all())
        assert bool((ids[i, :, k:] == -1).all()), f"row {i} lists more than its {k} tokens"
        for j in range(start, start + g):
            row_ids, row_values = ids[i, j, :k].tolist(), values[i, j, :k]
            assert len(set(row_ids)) == k and min(row_ids, default=0) >= 0, f"row {i}: {row_ids}"
            assert bool((row_values[1:] <= row_values[:-1]).all()), f"row {i}: not ranked"
            assert bool((row_values <= 0).all()), f"row {i}: a logprob above 0"
            token, logprob = int(out["output_ids"][i, j]), float(out["logprobs"][i, j])
            if token in row_ids:
                entry = float(row_values[row_ids.index(token)])
                assert abs(entry - logprob) <= 1e-6, f"row {i} pos {j}: {entry} != {logprob}"
            if greedy and k:
                assert logprob >= float(row_values[0]) - near, f"row {i}: greedy not the top"


def _assert_top_same(
    subject: ConformanceSubject, expected: Any, got: Any, row: int, k: int
) -> None:
    """The row's k top-k entries agree where the generated tokens agree (before any near-tie
    split); a batch mate's larger k leaves -1 beyond this row's."""
    dtype = subject.backend.config.get("dtype", "float32")
    tolerance = tolerance_for(dtype, across_backends=False)
    assert expected["topk_ids"].shape[2] == k, f"row {row} alone: K is not its own {k}"
    assert bool((got["topk_ids"][0, :, k:] == -1).all()), f"row {row}: entries past its {k}"
    n = min(expected["output_ids"].shape[1], got["output_ids"].shape[1])
    same = (expected["output_ids"][0, :n] == got["output_ids"][0, :n]).long().cumprod(0).bool()
    a, b = expected["topk_logprobs"][0, :n, :k][same], got["topk_logprobs"][0, :n, :k][same]
    assert torch.equal(a.isinf(), b.isinf()), f"row {row}: tokens filtered out differ"
    finite = ~a.isinf()
    if bool(finite.any()):
        gap = float((a[finite] - b[finite]).abs().max())
        assert gap <= tolerance.processed_logprob_atol, f"row {row}: top-k logprobs differ {gap}"


def _assert_ids_agree(a: Any, b: Any, near_tie: float, what: str) -> None:
    """Top-k ids equal wherever neighbouring values are not within ``near_tie`` of each other."""
    ids_a, ids_b, values = a["topk_ids"], b["topk_ids"], a["topk_logprobs"]
    clear = torch.ones_like(ids_a, dtype=torch.bool)
    if values.shape[-1] > 1:
        close = (values[..., :-1] - values[..., 1:]).abs() <= near_tie
        clear[..., :-1] &= ~close
        clear[..., 1:] &= ~close
    differ = (ids_a != ids_b) & clear
    assert not bool(differ.any()), f"{what}: top-k ids differ at {differ.nonzero()[:3].tolist()}"
