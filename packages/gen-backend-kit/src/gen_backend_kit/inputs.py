"""Input normalisation: any accepted padding layout becomes one canonical ``PromptBatch``.

Every backend calls ``normalize_generation_input`` first, so bad input is refused in one place,
before any worker is touched, with the same message whichever backend runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from gen_interface.errors import GenerationInputError

from gen_backend_kit.row_settings import parse_row_settings

__all__ = ["PromptBatch", "normalize_generation_input"]


@dataclass(frozen=True)
class PromptBatch:
    """A validated input batch in canonical form.

    Attributes:
        input_ids: int64 ``[B, S]``, each row's prompt left-aligned (right padding with
            ``pad_token_id``); ``S = max(input_lengths)``.
        input_lengths: int64 ``[B]``, the prompt length p_i of each row (>= 1).
        stop_strings: per-row extra stop strings (None for a row without).
        sample_seeds: int64 ``[B]`` per-row seeds given by the caller, or None.
        row_settings: per-row sampling settings the caller gave (``row_settings.ROW_SETTINGS``
            and ``stop_token_ids``): name -> one value per row.
        session_ids: per-row conversation keys (``GenerationDatumSpec.session_ids``), or None.
    """

    input_ids: torch.Tensor
    input_lengths: torch.Tensor
    stop_strings: list[list[str] | None]
    sample_seeds: torch.Tensor | None
    row_settings: Mapping[str, list[Any]] = field(default_factory=dict)
    session_ids: list[str | None] | None = None

    @property
    def size(self) -> int:
        return int(self.input_lengths.shape[0])

    def select(self, indices: list[int]) -> PromptBatch:
        """The rows at ``indices``, in that order, trimmed to their longest prompt."""
        index = torch.as_tensor(indices, dtype=torch.int64)
        lengths = self.input_lengths.index_select(0, index)
        width = int(lengths.max()) if len(indices) else 0
        return PromptBatch(
            input_ids=self.input_ids.index_select(0, index)[:, :width].contiguous(),
            input_lengths=lengths,
            stop_strings=[self.stop_strings[i] for i in indices],
            sample_seeds=None if self.sample_seeds is None else self.sample_seeds[index],
            row_settings={k: [v[i] for i in indices] for k, v in self.row_settings.items()},
            session_ids=None
            if self.session_ids is None
            else [self.session_ids[i] for i in indices],
        )

    def prompts(self) -> list[list[int]]:
        """Each row's unpadded prompt as a list of token ids."""
        return [row[:n].tolist() for row, n in zip(self.input_ids, self.input_lengths.tolist())]


def normalize_generation_input(
    data: Mapping[str, Any],
    *,
    pad_token_id: int,
    vocab_size: int | None = None,
    context_limit: int | None = None,
) -> PromptBatch:
    """Validate a ``GenerationDatumSpec`` batch and bring it to canonical form.

    Accepts ``attention_mask`` (left, right or mixed padding; each row's ones one contiguous run)
    or ``input_lengths`` (right padding). When both are given they must agree. Per-row
    ``stop_strings``, ``sample_seeds`` and sampling settings (``row_settings``) are checked too.

    Args:
        data: the batch, a ``BatchedDataDict[GenerationDatumSpec]`` or any mapping.
        pad_token_id: the id used to pad the canonical ``input_ids``.
        vocab_size: when given, every real token must lie in ``[0, vocab_size)``.
        context_limit: when given, every prompt must be shorter than it (room for one token).

    Raises:
        GenerationInputError: naming the field, the row and the offending value.
    """
    input_ids = data.get("input_ids")
    if not isinstance(input_ids, torch.Tensor):
        raise GenerationInputError(
            f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}"
        )
    if input_ids.dim() != 2:
        raise GenerationInputError(
            f"input_ids must be 2-D [B, S], got shape {tuple(input_ids.shape)}"
        )
    if (
        input_ids.dtype.is_floating_point
        or input_ids.dtype.is_complex
        or input_ids.dtype == torch.bool
    ):
        raise GenerationInputError(f"input_ids must hold integers, got dtype {input_ids.dtype}")
    input_ids = input_ids.detach().to("cpu", torch.int64)
    batch, width = input_ids.shape
    starts, lengths = _row_spans(data, batch, width)

    columns = torch.arange(width)
    # Shift each row so its run starts at column 0: gather column (start + j).
    gather_at = (starts[:, None] + columns[None, :]).clamp(max=max(width - 1, 0))
    canonical = input_ids.gather(1, gather_at) if width else input_ids
    real = columns[None, :] < lengths[:, None]
    canonical = torch.where(real, canonical, torch.full_like(canonical, pad_token_id))
    s_max = int(lengths.max()) if batch else 0
    canonical = canonical[:, :s_max].contiguous()
    real = real[:, :s_max]

    if vocab_size is not None and batch:
        bad = real & ((canonical < 0) | (canonical >= vocab_size))
        if bool(bad.any()):
            row, col = (int(x) for x in bad.nonzero()[0])
            raise GenerationInputError(
                f"input_ids row {row} holds token id {int(canonical[row, col])} at prompt "
                f"position {col}, outside the vocabulary [0, {vocab_size})"
            )
    elif batch and bool((real & (canonical < 0)).any()):
        row = int((real & (canonical < 0)).any(dim=1).nonzero()[0])
        raise GenerationInputError(f"input_ids row {row} holds a negative token id")

    if context_limit is not None and batch and int(lengths.max()) >= context_limit:
        row = int((lengths >= context_limit).nonzero()[0])
        raise GenerationInputError(
            f"input row {row} has a {int(lengths[row])}-token prompt; the model's context limit "
            f"is {context_limit} tokens, which leaves no room to generate"
        )
    return PromptBatch(
        input_ids=canonical,
        input_lengths=lengths,
        stop_strings=_stop_strings(data, batch),
        sample_seeds=_sample_seeds(data, batch),
        row_settings=parse_row_settings(data, batch),
        session_ids=_session_ids(data, batch),
    )


def _row_spans(
    data: Mapping[str, Any], batch: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Start column and length ``[B]`` of each row's real tokens."""
    mask = data.get("attention_mask")
    lengths_in = data.get("input_lengths")
    if mask is None and lengths_in is None:
        raise GenerationInputError("the batch needs attention_mask [B, S] or input_lengths [B]")
    spans: tuple[torch.Tensor, torch.Tensor] | None = None
    if mask is not None:
        spans = _spans_from_mask(mask, batch, width)
    if lengths_in is not None:
        lengths = _lengths_tensor(lengths_in, batch, width)
        if spans is not None:
            if not torch.equal(spans[1], lengths):
                row = int((spans[1] != lengths).nonzero()[0])
                raise GenerationInputError(
                    f"input_lengths row {row} is {int(lengths[row])} but attention_mask has "
                    f"{int(spans[1][row])} real tokens; give one of them or make them agree"
                )
        else:
            spans = (torch.zeros(batch, dtype=torch.int64), lengths)
    assert spans is not None
    return spans


def _spans_from_mask(mask: Any, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (batch, width):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise GenerationInputError(
            f"attention_mask must be a tensor of input_ids' shape {(batch, width)}, got {shape}"
        )
    mask = mask.detach().to("cpu")
    if batch == 0:
        empty_spans = torch.zeros(0, dtype=torch.int64)
        return empty_spans, empty_spans
    not_binary = ((mask != 0) & (mask != 1)).any(dim=1)  # floats such as 0.5 and NaN included
    if bool(not_binary.any()):
        row = int(not_binary.nonzero()[0])
        raise GenerationInputError(
            f"attention_mask row {row} holds values other than 0 and 1: "
            f"{mask[row][(mask[row] != 0) & (mask[row] != 1)][:3].tolist()}"
        )
    as_int = mask.to(torch.int64)
    lengths = as_int.sum(dim=1)
    empty = lengths == 0
    if bool(empty.any()):
        raise GenerationInputError(
            f"attention_mask row {int(empty.nonzero()[0])} has no real tokens; every prompt "
            "needs at least one"
        )
    starts = as_int.argmax(dim=1)
    columns = torch.arange(width)
    inside = (columns[None, :] >= starts[:, None]) & (
        columns[None, :] < (starts + lengths)[:, None]
    )
    broken = (inside.to(torch.int64) != as_int).any(dim=1)
    if bool(broken.any()):
        row = int(broken.nonzero()[0])
        raise GenerationInputError(
            f"attention_mask row {row} is {as_int[row].tolist()}: its real tokens must form "
            "one contiguous run (left, right or mixed padding)"
        )
    return starts, lengths


def _lengths_tensor(value: Any, batch: int, width: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != (batch,):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise GenerationInputError(
            f"input_lengths must be a tensor of shape ({batch},), got {shape}"
        )
    if value.dtype.is_floating_point or value.dtype == torch.bool:
        raise GenerationInputError(f"input_lengths must hold integers, got dtype {value.dtype}")
    lengths = value.detach().to("cpu", torch.int64)
    bad = (lengths < 1) | (lengths > width)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise GenerationInputError(
            f"input_lengths row {row} is {int(lengths[row])}; it must be in [1, {width}]"
        )
    return lengths


def _stop_strings(data: Mapping[str, Any], batch: int) -> list[list[str] | None]:
    value = data.get("stop_strings")
    if value is None:
        return [None] * batch
    if not isinstance(value, list | tuple) or len(value) != batch:
        raise GenerationInputError(
            f"stop_strings must be a list of {batch} entries (one per row), got {value!r:.80}"
        )
    rows: list[list[str] | None] = []
    for i, row in enumerate(value):
        if row is not None and (
            not isinstance(row, list | tuple) or not all(isinstance(s, str) and s for s in row)
        ):
            raise GenerationInputError(
                f"stop_strings row {i} must be None or a list of non-empty strings, got {row!r}"
            )
        rows.append(None if row is None else list(row))
    return rows


def _session_ids(data: Mapping[str, Any], batch: int) -> list[str | None] | None:
    value = data.get("session_ids")
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) != batch:
        raise GenerationInputError(
            f"session_ids must be a list of {batch} entries (one per row), got {value!r:.80}"
        )
    for i, session in enumerate(value):
        if session is not None and (not isinstance(session, str) or not session):
            raise GenerationInputError(
                f"session_ids row {i} must be None or a non-empty string, got {session!r}"
            )
    return list(value)


def _sample_seeds(data: Mapping[str, Any], batch: int) -> torch.Tensor | None:
    value = data.get("sample_seeds")
    if value is None:
        return None
    if (
        not isinstance(value, torch.Tensor)
        or tuple(value.shape) != (batch,)
        or value.dtype.is_floating_point
        or value.dtype == torch.bool
    ):
        raise GenerationInputError(
            f"sample_seeds must be an integer tensor of shape ({batch},), got {value!r:.80}"
        )
    seeds = value.detach().to("cpu", torch.int64)
    if bool((seeds < 0).any()):
        row = int((seeds < 0).nonzero()[0])
        raise GenerationInputError(
            f"sample_seeds row {row} is {int(seeds[row])}; seeds must be >= 0"
        )
    return seeds
