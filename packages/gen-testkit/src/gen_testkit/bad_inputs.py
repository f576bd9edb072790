"""Malformed input batches that every backend must refuse with ``GenerationInputError``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BAD_INPUTS"]


def _good(vocab_size: int) -> dict[str, Any]:
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]], dtype=torch.int64) % vocab_size
    return {"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])}


def _with(**changes: Any) -> Callable[[int], dict[str, Any]]:
    def build(vocab_size: int) -> dict[str, Any]:
        batch = _good(vocab_size)
        for key, value in changes.items():
            if value is None:
                batch.pop(key, None)
            else:
                batch[key] = value(vocab_size) if callable(value) else value
        return batch

    return build


#: ``{what is wrong: vocab_size -> batch}``; each batch breaks exactly one input rule.
BAD_INPUTS: dict[str, Callable[[int], dict[str, Any]]] = {
    "input_ids is a list": _with(input_ids=[[5, 6, 7, 0], [8, 9, 0, 0]]),
    "input_ids holds floats": _with(input_ids=torch.tensor([[5.0, 6, 7, 0], [8, 9, 0, 0]])),
    "input_ids is 1-D": _with(
        input_ids=torch.tensor([5, 6, 7, 0]), attention_mask=None, input_lengths=torch.tensor([3])
    ),
    "neither attention_mask nor input_lengths": _with(attention_mask=None),
    "attention_mask has the wrong shape": _with(attention_mask=torch.ones(2, 3, dtype=torch.int64)),
    "attention_mask row is not contiguous": _with(
        attention_mask=torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]])
    ),
    "attention_mask row is all padding": _with(
        attention_mask=torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    ),
    "attention_mask holds a 2": _with(attention_mask=torch.tensor([[1, 2, 1, 0], [1, 1, 0, 0]])),
    "float attention_mask holds 0.5": _with(
        attention_mask=torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.5, 0.0, 0.0]])
    ),
    "token id at the vocabulary size": _with(
        input_ids=lambda v: torch.tensor([[5, v, 7, 0], [8, 9, 0, 0]])
    ),
    "negative token id": _with(input_ids=torch.tensor([[5, -4, 7, 0], [8, 9, 0, 0]])),
    "input_lengths longer than the row": _with(
        attention_mask=None, input_lengths=torch.tensor([3, 5])
    ),
    "input_lengths of zero": _with(attention_mask=None, input_lengths=torch.tensor([3, 0])),
    "input_lengths disagree with attention_mask": _with(input_lengths=torch.tensor([3, 1])),
    "stop_strings has the wrong length": _with(stop_strings=[["x"]]),
    "sample_seeds has the wrong shape": _with(sample_seeds=torch.tensor([1, 2, 3])),
    "negative sample seed": _with(sample_seeds=torch.tensor([1, -2])),
    "session_ids has the wrong length": _with(session_ids=["a"]),
    "session_ids holds a number": _with(session_ids=["a", 7]),
}
