"""Hypothesis strategies for generation batches and configs.

Batches are built from their prompts, so a test can always ask what the rows are: every strategy
here that makes a batch returns a ``DrawnBatch`` holding both the padded batch and the prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from gen_interface import BatchedDataDict, GenerationDatumSpec
from gen_interface.specs import ScoreSpec
from hypothesis import strategies as st

__all__ = [
    "DrawnBatch",
    "Padding",
    "generation_batches",
    "generation_configs",
    "invalid_config_fields",
    "pad_prompts",
    "prompts",
    "score_batch",
]

Padding = Literal["left", "right", "mixed", "lengths"]
PADDINGS: tuple[Padding, ...] = ("left", "right", "mixed", "lengths")


@dataclass(frozen=True)
class DrawnBatch:
    """A drawn batch and the prompts it was built from."""

    data: BatchedDataDict[GenerationDatumSpec]
    prompts: list[list[int]]
    padding: Padding


def pad_prompts(
    rows: Sequence[Sequence[int]],
    padding: Padding,
    *,
    pad_token_id: int = 0,
    width: int | None = None,
    offsets: Sequence[int] | None = None,
) -> BatchedDataDict[GenerationDatumSpec]:
    """Lay prompts out in one of the accepted input layouts.

    Args:
        rows: unpadded prompts, each at least one token.
        padding: ``left``/``right`` (with ``attention_mask``), ``mixed`` (each row at its own
            offset, from ``offsets``), or ``lengths`` (right padding with ``input_lengths``).
        width: padded width ``S``; default the longest row (plus the largest mixed offset).
        offsets: for ``mixed``, how many pad tokens precede each row.
    """
    lengths = [len(r) for r in rows]
    if padding == "mixed":
        offsets = list(offsets) if offsets is not None else [i % 3 for i in range(len(rows))]
    else:
        offsets = [0] * len(rows)
    needed = max((n + o for n, o in zip(lengths, offsets)), default=0)
    width = needed if width is None else width
    if width < needed:
        raise ValueError(f"width {width} is smaller than the {needed} columns the rows need")
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, (row, n) in enumerate(zip(rows, lengths)):
        start = width - n if padding == "left" else offsets[i]
        input_ids[i, start : start + n] = torch.tensor(list(row), dtype=torch.int64)
        mask[i, start : start + n] = 1
    if padding == "lengths":
        return BatchedDataDict(
            input_ids=input_ids, input_lengths=torch.tensor(lengths, dtype=torch.int64)
        )
    return BatchedDataDict(input_ids=input_ids, attention_mask=mask)


def score_batch(
    sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]
) -> BatchedDataDict[ScoreSpec]:
    """Complete sequences (prompt then response) as ``score``'s input: right-padded with 0."""
    width = max((len(s) for s in sequences), default=0)
    ids = torch.zeros((len(sequences), width), dtype=torch.int64)
    for i, sequence in enumerate(sequences):
        ids[i, : len(sequence)] = torch.tensor(list(sequence), dtype=torch.int64)
    return BatchedDataDict(
        input_ids=ids,
        prompt_lengths=torch.tensor(list(prompt_lengths), dtype=torch.int64),
        unpadded_sequence_lengths=torch.tensor([len(s) for s in sequences], dtype=torch.int64),
    )


def prompts(
    vocab_size: int,
    *,
    min_rows: int = 1,
    max_rows: int = 6,
    min_length: int = 1,
    max_length: int = 12,
    low_token: int = 3,
) -> st.SearchStrategy[list[list[int]]]:
    """Lists of prompts: token ids in ``[low_token, vocab_size)`` (specials below are avoided)."""
    token = st.integers(min_value=low_token, max_value=vocab_size - 1)
    row = st.lists(token, min_size=min_length, max_size=max_length)
    return st.lists(row, min_size=min_rows, max_size=max_rows)


@st.composite
def generation_batches(
    draw: st.DrawFn,
    vocab_size: int,
    *,
    min_rows: int = 1,
    max_rows: int = 6,
    max_length: int = 12,
    paddings: Sequence[Padding] = PADDINGS,
    pad_token_id: int = 0,
) -> DrawnBatch:
    """Batches with any accepted padding layout, token ids inside the vocabulary."""
    rows = draw(prompts(vocab_size, min_rows=min_rows, max_rows=max_rows, max_length=max_length))
    padding = draw(st.sampled_from(list(paddings)))
    offsets = draw(st.lists(st.integers(0, 3), min_size=len(rows), max_size=len(rows)))
    extra = draw(st.integers(0, 2))
    needed = max(
        (len(r) + (o if padding == "mixed" else 0) for r, o in zip(rows, offsets)), default=0
    )
    data = pad_prompts(
        rows, padding, pad_token_id=pad_token_id, width=needed + extra, offsets=offsets
    )
    return DrawnBatch(data=data, prompts=rows, padding=padding)


@st.composite
def generation_configs(
    draw: st.DrawFn, *, backend: str, model_name: str, vocab_size: int, pad_token_id: int = 0
) -> dict[str, Any]:
    """Valid, complete ``GenerationConfig`` dicts covering the sampling settings."""
    top_k = draw(st.one_of(st.none(), st.just(-1), st.integers(1, vocab_size)))
    return {
        "backend": backend,
        "model_name": model_name,
        "max_new_tokens": draw(st.integers(1, 16)),
        "temperature": draw(st.one_of(st.just(0.0), st.floats(0.05, 2.0))),
        "top_p": draw(st.floats(0.05, 1.0)),
        "top_k": top_k,
        "min_p": draw(st.sampled_from([0.0, 0.05, 1.0])),
        "top_logprobs": draw(st.integers(0, 5)),
        "stop_token_ids": draw(
            st.one_of(st.none(), st.lists(st.integers(0, vocab_size - 1), max_size=4))
        ),
        "stop_strings": None,
        "pad_token_id": pad_token_id,
        "logprobs_mode": draw(st.sampled_from(["raw", "processed"])),
        "seed": draw(st.one_of(st.none(), st.integers(0, 2**31 - 1))),
        "dtype": draw(st.sampled_from(["auto", "float32", "bfloat16", "float16"])),
        "colocated": {"enabled": draw(st.booleans())},
        "max_weight_staleness": draw(st.one_of(st.none(), st.integers(0, 8))),
        "batch_invariant": False,
        "lm_head_fp32": False,
        "return_routed_experts": False,
        "lora": None,
        "speculative": None,
    }


#: Out-of-range values for every validated config field.
_INVALID_VALUES: dict[str, list[Any]] = {
    "backend": [None, "", 3],
    "model_name": [None, "", 1.5],
    "max_new_tokens": [0, -3, 2.5, "8", True, None],
    "temperature": [-0.1, float("nan"), float("inf"), "1", None],
    "top_p": [0.0, -0.5, 1.01, float("nan"), None],
    "top_k": [0, -2, 1.5, "5"],
    "min_p": [-0.1, 1.5, float("nan"), "0.1", None],
    "top_logprobs": [-1, 1.5, "2", True, None],
    "stop_token_ids": [[-1], ["a"], 5, [1.5], [True]],
    "stop_strings": ["stop", [""], [3]],
    "pad_token_id": [-1, 1.5, "0", None],
    "logprobs_mode": ["log", None, "processed_logprobs"],
    "seed": [-1, 1.5, "7"],
    "dtype": ["fp32", "float64", None],
    "colocated": [True, {}, {"enabled": "yes"}, None],
    "max_weight_staleness": [-1, 1.5, "2", True],
    "batch_invariant": ["yes", 1, None],
    "lm_head_fp32": ["yes", 1, None],
    "return_routed_experts": ["yes", 1, None],
    "lora": [True, "q_proj", {"rank": 0, "alpha": 8, "target_modules": ["q_proj"]}],
    "speculative": [
        "ngram",
        {"method": "medusa", "num_speculative_tokens": 3},
        {"method": "ngram", "num_speculative_tokens": 0},
        {"method": "draft_model", "num_speculative_tokens": 3},
        {"method": "ngram", "num_speculative_tokens": 3, "min_acceptance_rate": 1.5},
        *(
            {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "num_speculative_tokens_per_batch_size": v,
            }
            for v in ([], [[2, 8, 3]], [[1, 8, 4]], [[1, 8, 3], [8, 16, 0]], [[1, 8]], [[1, 0, 3]])
        ),
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 4,
            "prompt_lookup_max": 2,
        },
    ],
}


def invalid_config_fields() -> st.SearchStrategy[tuple[str, Any]]:
    """``(field, out-of-range value)`` pairs, one strategy over every validated field."""
    return st.sampled_from([(k, v) for k, values in _INVALID_VALUES.items() for v in values])
