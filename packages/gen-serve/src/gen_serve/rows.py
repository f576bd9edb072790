"""From one request to the rows of one backend call: prompts times ``n``, each with its settings.

Row ``i * n + j`` is sample j of prompt i, which is also its choice index, as in vLLM. Every
row carries the request's settings as per-row entries (``GenerationDatumSpec``), so requests
with different settings never need different backend configs. Stop token ids follow vLLM: the
request's own, plus the model's end-of-sequence token unless ``ignore_eos``.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import torch
from gen_interface import BatchedDataDict
from gen_interface.seeds import MAX_SEED, derive_sample_seeds

from gen_serve.errors import ApiError
from gen_serve.protocol import SamplingFields

__all__ = ["RowPlan", "plan_rows"]


@dataclass(frozen=True)
class RowPlan:
    """One request's rows.

    Attributes:
        prompts: each prompt's token ids.
        n: samples per prompt.
        batch: the backend's input: ``len(prompts) * n`` rows, right-padded, with per-row
            settings.
        stop_token_ids: the ids that end a row (for ``stop_reason``).
        eos_token_id: the model's end of sequence (its stop is reported as ``stop_reason``
            null, as vLLM does).
        stop_strings: the request's stop strings.
        top_logprobs: how many top logprobs each row reports.
        max_weight_staleness: the request's staleness bound (None: the backend's config's).
    """

    prompts: list[list[int]]
    n: int
    batch: BatchedDataDict[Any]
    stop_token_ids: frozenset[int]
    eos_token_id: int | None
    stop_strings: list[str]
    top_logprobs: int
    max_weight_staleness: int | None = None

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, row: int) -> int:
        return row // self.n


def plan_rows(
    prompts: list[list[int]],
    fields: SamplingFields,
    *,
    max_tokens: int | None,
    top_logprobs: int,
    defaults: dict[str, Any],
    eos_token_id: int | None,
    context_limit: int | None,
    pad_token_id: int,
    max_rows: int,
) -> RowPlan:
    """The rows of one request.

    Args:
        prompts: token ids of each prompt (each non-empty).
        fields: the request's sampling fields.
        max_tokens: tokens per row; None: up to the context limit.
        top_logprobs: top logprobs per generated token.
        defaults: the server's defaults for unset fields (``temperature``, ``top_p``, ``top_k``,
            ``min_p``), e.g. from the model's generation config.
        eos_token_id: the model's end of sequence.
        context_limit: the backend's longest prompt + generation (None: unknown).
        pad_token_id: the backend's pad id.
        max_rows: the most rows one request may bring.

    Raises:
        ApiError: 400 for too many rows, an empty prompt or a ``max_tokens`` above the context.
    """
    n = fields.n
    if len(prompts) * n > max_rows:
        raise ApiError(
            400, f"{len(prompts)} prompts x n={n} is more than {max_rows} rows per request", "n"
        )
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ApiError(400, f"prompt {i} is empty: The decoder prompt cannot be empty")
    if max_tokens is not None and context_limit is not None and max_tokens > context_limit:
        raise ApiError(
            400,
            f"max_tokens={max_tokens} cannot be greater than max_model_len={context_limit}. "
            "Please request fewer output tokens.",
            "max_tokens",
        )
    rows = [prompt for prompt in prompts for _ in range(n)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    limit = context_limit or (width + (max_tokens or 16))
    new = [max_tokens or max(1, limit - len(r)) for r in rows]
    stop_ids = list(dict.fromkeys(fields.stop_token_ids or []))
    if not fields.ignore_eos and eos_token_id is not None and eos_token_id not in stop_ids:
        stop_ids.append(eos_token_id)

    def value(name: str) -> Any:
        given = getattr(fields, name)
        return given if given is not None else defaults[name]

    seed = fields.seed
    base = secrets.randbits(64) if seed is None else seed & MAX_SEED
    batch: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        max_new_tokens=torch.tensor(new, dtype=torch.int64),
        temperature=torch.full((len(rows),), float(value("temperature"))),
        top_p=torch.full((len(rows),), float(value("top_p"))),
        top_k=torch.full((len(rows),), int(value("top_k")), dtype=torch.int64),
        min_p=torch.full((len(rows),), float(value("min_p"))),
        top_logprobs=torch.full((len(rows),), top_logprobs, dtype=torch.int64),
        stop_token_ids=[list(stop_ids) for _ in rows],
        sample_seeds=torch.tensor(derive_sample_seeds(base, len(rows)), dtype=torch.int64),
    )
    if fields.stop_strings:
        batch["stop_strings"] = [list(fields.stop_strings) for _ in rows]
    return RowPlan(
        prompts=prompts,
        n=n,
        batch=batch,
        stop_token_ids=frozenset(stop_ids),
        eos_token_id=eos_token_id,
        stop_strings=fields.stop_strings,
        top_logprobs=top_logprobs,
    )
