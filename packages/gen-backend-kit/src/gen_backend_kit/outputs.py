"""Output assembly: per-row generated tokens become the CONTRACT's ``GenerationOutputSpec`` layout.

Backends produce, for each row, its generated token ids, their log-probabilities and whether it
stopped for length; ``build_generation_output`` lays them out, so every backend's output has the
same shapes, dtypes and padding by construction.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from gen_interface.batched_data_dict import BatchedDataDict
from gen_interface.errors import GenerationError
from gen_interface.events import RowEvent
from gen_interface.specs import GenerationOutputSpec

from gen_backend_kit.inputs import PromptBatch

__all__ = [
    "FinishReason",
    "RowResult",
    "build_generation_output",
    "build_row_output",
    "check_every_row",
    "last_event",
    "lay_out_routed_experts",
]

#: Why a row ended: a stop token or string, the length limit (``max_new_tokens`` or the context
#: limit), or cut short by a weight update (its tokens so far kept).
FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class RowResult:
    """What a backend generated for one row.

    Attributes:
        token_ids: the g generated token ids, stop token included when one ended the row.
        logprobs: g log-probabilities, one per generated token, in the config's logprobs mode.
        truncated: True when the row stopped for length (``max_new_tokens`` or the context limit).
        weight_version: the weight version the row started on.
        weight_versions: the version that produced each token (g of them); None when every
            token came from ``weight_version``.
        cut_short: the row was ended early by a weight update in ``"abort"`` mode; its tokens so
            far are kept (``truncated`` is then False).
        topk_ids: per generated token, the ids of its likeliest tokens (the row's
            ``top_logprobs`` of them, most likely first); None when the row asked for none.
        topk_logprobs: their logprobs, the same shape.
        routed_experts: int ``[n, layers, top_k]``: the experts each MoE layer routed the
            row's positions ``0 .. n - 1`` to (prompt, then generated tokens; every position
            the model read); None when not asked for (``return_routed_experts``).
    """

    token_ids: Sequence[int]
    logprobs: Sequence[float]
    truncated: bool
    weight_version: int = 0
    weight_versions: Sequence[int] | None = None
    cut_short: bool = False
    topk_ids: Sequence[Sequence[int]] | None = None
    topk_logprobs: Sequence[Sequence[float]] | None = None
    routed_experts: torch.Tensor | None = None

    @classmethod
    def ended(
        cls,
        finish_reason: str | None,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        *,
        weight_version: int = 0,
        weight_versions: Sequence[int] | None = None,
        topk_ids: Sequence[Sequence[int]] | None = None,
        topk_logprobs: Sequence[Sequence[float]] | None = None,
        routed_experts: torch.Tensor | None = None,
    ) -> RowResult:
        """The result of a row an engine reported as ended for ``finish_reason``.

        Raises:
            GenerationError: the reason is not a ``FinishReason`` (an engine error, say): a row
                that did not end for a known reason is never passed off as a length cut-off.
        """
        if finish_reason not in get_args(FinishReason):
            raise GenerationError(
                f"the engine ended a row for {finish_reason!r}, not one of "
                f"{list(get_args(FinishReason))}, after {len(token_ids)} tokens: the row failed "
                "inside the engine; its output is not returned"
            )
        return cls(
            token_ids,
            logprobs,
            truncated=finish_reason == "length",
            weight_version=weight_version,
            weight_versions=weight_versions,
            cut_short=finish_reason == "abort",
            topk_ids=topk_ids,
            topk_logprobs=topk_logprobs,
            routed_experts=routed_experts,
        )

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"a row has {len(self.token_ids)} tokens but {len(self.logprobs)} logprobs"
            )
        if self.weight_versions is not None and len(self.weight_versions) != len(self.token_ids):
            raise ValueError(
                f"a row has {len(self.token_ids)} tokens but {len(self.weight_versions)} versions"
            )
        for name in ("topk_ids", "topk_logprobs"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self.token_ids):
                raise ValueError(
                    f"a row has {len(self.token_ids)} tokens but {len(value)} {name} entries"
                )


def build_generation_output(
    prompts: PromptBatch,
    rows: Sequence[RowResult],
    pad_token_id: int,
    top_logprobs: int = 0,
    routed_experts: tuple[int, int] | None = None,
) -> BatchedDataDict[GenerationOutputSpec]:
    """Lay out ``rows`` (one per prompt, in input order) as a ``GenerationOutputSpec`` batch.

    Args:
        prompts: the call's prompts.
        rows: one result per prompt.
        pad_token_id: fills ``output_ids`` past each row's end.
        top_logprobs: ``K``, the width of the top-k fields (the most any row asked for).
        routed_experts: ``(layers, top_k)`` of the model's routing when the call returns it
            (``return_routed_experts``), else None.

    Returns:
        ``output_ids`` int64 ``[B, L]``, ``logprobs`` float32 ``[B, L]``, ``generation_lengths``
        and ``unpadded_sequence_lengths`` int64 ``[B]``, ``truncated`` and ``cut_short`` bool
        ``[B]``, ``weight_version`` int64 ``[B]`` and ``weight_versions`` int64 ``[B, L]`` (the
        version of each generated token, 0 elsewhere), ``topk_ids`` int64 and
        ``topk_logprobs`` float32 ``[B, L, K]`` (-1 and 0.0 where nothing was asked), and with
        ``routed_experts``, ``routed_experts`` int16 ``[B, L, layers, top_k]`` (-1 where the model
        read no token), where ``L = max_i(p_i + g_i)``. An empty batch gives every field with
        ``B = 0`` (and ``L = 0``).
    """
    if len(rows) != prompts.size:
        raise ValueError(f"{len(rows)} results for {prompts.size} prompts")
    prompt_lengths = prompts.input_lengths
    generation_lengths = torch.tensor([len(r.token_ids) for r in rows], dtype=torch.int64)
    total = prompt_lengths + generation_lengths
    width = int(total.max()) if rows else 0
    output_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.int64)
    logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
    versions = torch.zeros((len(rows), width), dtype=torch.int64)
    topk_ids = torch.full((len(rows), width, top_logprobs), -1, dtype=torch.int64)
    topk_logprobs = torch.zeros((len(rows), width, top_logprobs), dtype=torch.float32)
    prompt_width = prompts.input_ids.shape[1]
    if rows:
        output_ids[:, :prompt_width] = torch.where(
            torch.arange(prompt_width)[None, :] < prompt_lengths[:, None],
            prompts.input_ids,
            pad_token_id,
        )
    for i, row in enumerate(rows):
        start, count = int(prompt_lengths[i]), len(row.token_ids)
        if count:
            output_ids[i, start : start + count] = torch.as_tensor(row.token_ids, dtype=torch.int64)
            logprobs[i, start : start + count] = torch.as_tensor(row.logprobs, dtype=torch.float32)
            versions[i, start : start + count] = (
                row.weight_version
                if row.weight_versions is None
                else torch.as_tensor(row.weight_versions, dtype=torch.int64)
            )
        if count and top_logprobs and row.topk_ids is not None and row.topk_logprobs is not None:
            ids = torch.as_tensor(row.topk_ids, dtype=torch.int64).reshape(count, -1)
            values = torch.as_tensor(row.topk_logprobs, dtype=torch.float32).reshape(count, -1)
            k = min(ids.shape[1], top_logprobs)
            topk_ids[i, start : start + count, :k] = ids[:, :k]
            topk_logprobs[i, start : start + count, :k] = values[:, :k]
    out: BatchedDataDict[GenerationOutputSpec] = BatchedDataDict(
        output_ids=output_ids,
        logprobs=logprobs,
        generation_lengths=generation_lengths,
        unpadded_sequence_lengths=total,
        truncated=torch.tensor([r.truncated for r in rows], dtype=torch.bool),
        cut_short=torch.tensor([r.cut_short for r in rows], dtype=torch.bool),
        weight_version=torch.tensor([r.weight_version for r in rows], dtype=torch.int64),
        weight_versions=versions,
        topk_ids=topk_ids,
        topk_logprobs=topk_logprobs,
    )
    if routed_experts is not None:
        out["routed_experts"] = lay_out_routed_experts(
            [r.routed_experts for r in rows], width, routed_experts
        )
    return out


def lay_out_routed_experts(
    per_row: Sequence[torch.Tensor | None], width: int, shape: tuple[int, int]
) -> torch.Tensor:
    """Per-row routed experts (row i: ``[n_i, layers, top_k]`` for positions ``0 .. n_i - 1``,
    or None) as int16 ``[B, width, layers, top_k]``, -1 past each row's ``n_i``.

    Raises:
        GenerationError: a row's routing does not have the model's ``(layers, top_k)`` shape or
            is longer than ``width`` (a backend fault: nothing is returned).
    """
    out = torch.full((len(per_row), width, *shape), -1, dtype=torch.int16)
    for i, experts in enumerate(per_row):
        if experts is None:
            continue
        if tuple(experts.shape[1:]) != shape or experts.shape[0] > width:
            raise GenerationError(
                f"the backend's routed experts for row {i} have shape {tuple(experts.shape)}; "
                f"expected [<= {width}, {shape[0]}, {shape[1]}]: its routing capture is out of "
                "step with the model"
            )
        out[i, : experts.shape[0]] = experts.to(torch.int16)
    return out


def build_row_output(
    prompts: PromptBatch,
    index: int,
    row: RowResult,
    pad_token_id: int,
    top_logprobs: int = 0,
    routed_experts: tuple[int, int] | None = None,
) -> BatchedDataDict[GenerationOutputSpec]:
    """The one-row output of row ``index`` (what ``generate_async`` yields), ``L = p_i + g_i``;
    ``top_logprobs`` and ``routed_experts`` as for ``build_generation_output``."""
    return build_generation_output(
        prompts.select([index]), [row], pad_token_id, top_logprobs, routed_experts
    )


def check_every_row(present: Collection[int], count: int) -> None:
    """Raise ``GenerationError`` naming the rows of ``range(count)`` not in ``present``."""
    missing = [i for i in range(count) if i not in present]
    if missing:
        raise GenerationError(
            f"the backend returned no result for {len(missing)} of {count} rows (rows "
            f"{missing[:8]}{'...' if len(missing) > 8 else ''}); nothing of this call is returned"
        )


def last_event(
    index: int, result: RowResult, sent: int, output: BatchedDataDict[GenerationOutputSpec]
) -> RowEvent:
    """The last ``RowEvent`` of row ``index``: the tokens of ``result`` past the ``sent``
    already streamed, and the row's one-row ``output``."""
    new = slice(sent, None)
    tokens = list(result.token_ids[new])
    no_top: list[list[Any]] = [[] for _ in tokens]
    return RowEvent(
        index,
        tokens,
        list(result.logprobs[new]),
        [list(x) for x in result.topk_ids[new]] if result.topk_ids else no_top,
        [list(x) for x in result.topk_logprobs[new]] if result.topk_logprobs else no_top,
        output,
    )
