"""Per-row sampling settings carried by an input batch, checked like every other input.

A batch may carry, for each row, its own value of any of ``ROW_SETTINGS``: that row is then
generated exactly as a batch of that row alone would be with the value in the config. Numeric
settings are tensors ``[B]``; ``stop_token_ids`` is a list of ``B`` entries, each a list of ids or
None (the config's). ``stop_strings`` and ``sample_seeds`` predate this module and keep their
own rules (``inputs.py``): a row's stop strings are added to the config's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from gen_interface.errors import GenerationInputError

__all__ = ["ROW_SETTINGS", "parse_row_settings"]


def _int_at_least(minimum: int) -> Callable[[float], str | None]:
    def check(value: float) -> str | None:
        return None if value == int(value) and value >= minimum else f"an integer >= {minimum}"

    return check


def _in_range(low: float, high: float, *, open_low: bool = False) -> Callable[[float], str | None]:
    def check(value: float) -> str | None:
        ok = math.isfinite(value) and (value > low if open_low else value >= low) and value <= high
        return None if ok else f"in {'(' if open_low else '['}{low:g}, {high:g}]"

    return check


def _top_k(value: float) -> str | None:
    return (
        None
        if value == int(value) and (value >= 1 or value in (0, -1))
        else ("an integer >= 1, or 0 or -1 for off")
    )


#: The per-row settings: name -> (integer?, what a value must satisfy).
ROW_SETTINGS: dict[str, tuple[bool, Callable[[float], str | None]]] = {
    "max_new_tokens": (True, _int_at_least(1)),
    "temperature": (False, _in_range(0.0, math.inf)),
    "top_p": (False, _in_range(0.0, 1.0, open_low=True)),
    "top_k": (True, _top_k),
    "min_p": (False, _in_range(0.0, 1.0)),
    "top_logprobs": (True, _int_at_least(0)),
}


def parse_row_settings(data: Mapping[str, Any], batch: int) -> dict[str, list[Any]]:
    """The batch's per-row settings, each a list of ``batch`` Python values.

    ``top_k`` of 0 or -1 means off; ``stop_token_ids`` rows are lists of ints or None (the
    config's).

    Raises:
        GenerationInputError: a setting is not a tensor ``[B]`` (a list of ``B`` entries for
            ``stop_token_ids``) or a row's value is out of range; naming the setting and row.
    """
    out: dict[str, list[Any]] = {}
    for name, (integer, check) in ROW_SETTINGS.items():
        value = data.get(name)
        if value is None:
            continue
        if (
            not isinstance(value, torch.Tensor)
            or tuple(value.shape) != (batch,)
            or value.dtype == torch.bool
            or value.dtype.is_complex
            or (integer and value.dtype.is_floating_point)
        ):
            kind = "an integer" if integer else "a number"
            raise GenerationInputError(
                f"{name} must be {kind} tensor of shape ({batch},) (one per row), got {value!r:.80}"
            )
        values = value.detach().to("cpu", torch.float64).tolist()
        for row, v in enumerate(values):
            problem = check(v)
            if problem is not None:
                raise GenerationInputError(f"{name} row {row} is {v:g}; it must be {problem}")
        out[name] = [int(v) for v in values] if integer else values
    ids = data.get("stop_token_ids")
    if ids is not None:
        out["stop_token_ids"] = _stop_token_ids(ids, batch)
    return out


def _stop_token_ids(value: Any, batch: int) -> list[list[int] | None]:
    if not isinstance(value, list | tuple) or len(value) != batch:
        raise GenerationInputError(
            f"stop_token_ids must be a list of {batch} entries (one per row), got {value!r:.80}"
        )
    rows: list[list[int] | None] = []
    for i, row in enumerate(value):
        if row is not None and (
            not isinstance(row, list | tuple)
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in row)
        ):
            raise GenerationInputError(
                f"stop_token_ids row {i} must be None or a list of token ids (integers >= 0), "
                f"got {row!r:.80}"
            )
        rows.append(None if row is None else list(row))
    return rows
