"""One row on the wire: its request to ``/inference/v1/generate``, and its answer put back
together.

Every row is one request, with every setting resolved by the client (``RowSampling``), so the
server's own sampling config never applies. On a gen-serve server the row's seed travels as
``extra_args.sample_seed``, the ``sample_seeds`` entry that gives it the seed it has in process
(``derive_sample_seeds``): a sampled row draws the tokens it draws there. Top logprobs are
asked one deeper than wanted: vLLM's answer lists the chosen token first and cuts the list at
the number asked, so a chosen token outside the top k would push the k-th out.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from gen_backend_kit import RowResult, RowSampling
from gen_backend_kit.scoring import ScoredRow
from gen_interface import GenerationError, RowEvent

__all__ = ["RowAssembly", "generate_body", "score_body", "scored_row_from_answer"]

GENERATE = "/inference/v1/generate"

_INT63 = (1 << 63) - 1


def generate_body(
    prompt: Sequence[int],
    row: RowSampling,
    *,
    sample_seed: int,
    dialect: str,
    max_weight_staleness: int | None,
    session: str | None = None,
) -> dict[str, Any]:
    """The streamed request of one row; ``sample_seed`` is its ``sample_seeds`` entry (the
    caller's, or ``derive_sample_seeds``'), which gives it ``row.seed`` on the server;
    ``session`` its ``session_ids`` entry."""
    params: dict[str, Any] = {
        "max_tokens": row.max_new_tokens,
        "temperature": row.temperature,
        "top_p": row.top_p,
        "top_k": row.top_k if row.top_k is not None else -1,
        "min_p": row.min_p,
        "stop_token_ids": list(row.stop_token_ids),
        "ignore_eos": True,  # the row's stop ids are complete: the server adds none
        "logprobs": row.top_logprobs + 1 if row.top_logprobs else 0,
        "include_stop_str_in_output": True,
    }
    if row.stop_strings:
        params["stop"] = list(row.stop_strings)
    if dialect == "gen-serve":
        extras: dict[str, Any] = {"sample_seed": sample_seed}
        if max_weight_staleness is not None:
            extras["max_weight_staleness"] = max_weight_staleness
        params["extra_args"] = extras
    elif not row.greedy:
        params["seed"] = row.seed & _INT63
    body: dict[str, Any] = {"token_ids": list(prompt), "sampling_params": params, "stream": True}
    if session is not None:
        body["session_id"] = session
    return body


def score_body(sequence: Sequence[int], top_logprobs: int) -> dict[str, Any]:
    """The request that scores ``sequence``: its prompt logprobs, one greedy token after."""
    return {
        "token_ids": list(sequence),
        "sampling_params": {
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": top_logprobs,
            "ignore_eos": True,
        },
    }


def scored_row_from_answer(
    answer: Mapping[str, Any], sequence: Sequence[int], prompt_length: int, top_logprobs: int
) -> ScoredRow:
    """The response positions of ``answer``'s ``prompt_logprobs`` as a ``ScoredRow``.

    Raises:
        GenerationError: the answer lacks a position's logprob.
    """
    entries = answer.get("prompt_logprobs") or []
    if len(entries) != len(sequence):
        raise GenerationError(
            f"the server scored {len(entries)} positions of a {len(sequence)}-token sequence"
        )
    logprobs, ids, values = [], [], []
    for position in range(prompt_length, len(sequence)):
        entry = entries[position] or {}
        chosen = entry.get(str(sequence[position]))
        if chosen is None:
            raise GenerationError(f"the server sent no logprob for position {position}")
        logprobs.append(float(chosen["logprob"]))
        top = _top((int(token), float(e["logprob"]), e.get("rank")) for token, e in entry.items())[
            :top_logprobs
        ]
        ids.append([t for t, _ in top])
        values.append([v for _, v in top])
    g = len(logprobs)
    return ScoredRow(
        torch.tensor(logprobs, dtype=torch.float32),
        torch.tensor(ids, dtype=torch.int64).reshape(g, top_logprobs),
        torch.tensor(values, dtype=torch.float32).reshape(g, top_logprobs),
        routed_experts_of((answer.get("choices") or [{}])[0]),
    )


def routed_experts_of(choice: Mapping[str, Any]) -> torch.Tensor | None:
    """A final choice's ``routed_experts`` (base64 of a ``.npy``, as vLLM sends them) as int16
    ``[positions, layers, top_k]``; None when it has none."""
    encoded = choice.get("routed_experts")
    if not encoded:
        return None
    import numpy as np  # only where a server sends routing

    array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    return torch.from_numpy(array.astype(np.int16))


class RowAssembly:
    """A row's streamed choices, put together.

    Args:
        top_logprobs: how many top logprobs the row asked for.
    """

    def __init__(self, top_logprobs: int):
        self.top_logprobs = top_logprobs
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.topk_ids: list[list[int]] = []
        self.topk_logprobs: list[list[float]] = []
        self.finish_reason: str | None = None
        self.weight_version = 0
        self.weight_versions: list[int] | None = None
        self.routed_experts: torch.Tensor | None = None

    def add(self, index: int, choice: Mapping[str, Any]) -> RowEvent:
        """Take one choice of the stream; returns its new tokens as an event of row ``index``.

        Raises:
            GenerationError: the choice's tokens and logprobs do not match.
        """
        tokens = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(tokens):
            raise GenerationError(
                f"the server sent {len(tokens)} tokens with {len(content)} logprobs: ask the "
                "server for logprobs (it drops them only when asked for none)"
            )
        event = RowEvent(index, tokens, [], [], [], None)
        for entry in content:
            event.logprobs.append(float(entry["logprob"]))
            listed = [(int(entry["token_id"]), float(entry["logprob"]), entry.get("rank"))]
            listed += [
                (int(e["token_id"]), float(e["logprob"]), e.get("rank"))
                for e in entry.get("top_logprobs") or []
            ]
            top = _top(listed)[: self.top_logprobs]
            event.topk_ids.append([t for t, _ in top])
            event.topk_logprobs.append([v for _, v in top])
        self.tokens += event.token_ids
        self.logprobs += event.logprobs
        self.topk_ids += event.topk_ids
        self.topk_logprobs += event.topk_logprobs
        if choice.get("finish_reason") is not None:
            self.finish_reason = str(choice["finish_reason"])
            self.routed_experts = routed_experts_of(choice)
            spans = choice.get("weight_versions") or []
            version = _version(choice.get("weight_version"))
            if version is not None and all(_version(s["version"]) is not None for s in spans):
                self.weight_version = version  # vLLM's own server names no integer versions
                self.weight_versions = _expand(spans, len(self.tokens)) if spans else None
        return event

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def result(self, index: int) -> RowResult:
        """The row's result once its stream finished.

        Raises:
            GenerationError: the stream ended without a finish reason, or for one that is not
                the interface's (the row failed in the server).
        """
        if self.finish_reason is None:
            raise GenerationError(
                f"the server ended row {index}'s stream after {len(self.tokens)} tokens without "
                "saying why; the row is lost"
            )
        return RowResult.ended(
            self.finish_reason,
            self.tokens,
            self.logprobs,
            weight_version=self.weight_version,
            weight_versions=self.weight_versions,
            topk_ids=self.topk_ids if self.top_logprobs else None,
            topk_logprobs=self.topk_logprobs if self.top_logprobs else None,
            routed_experts=self.routed_experts,
        )


def _top(entries: Any) -> list[tuple[int, float]]:
    """The ranked entries (rank not None), most likely first, each token once."""
    seen: dict[int, tuple[int, float]] = {}
    for token, logprob, rank in entries:
        if rank is not None and token not in seen:
            seen[token] = (int(rank), logprob)
    ordered = sorted(seen.items(), key=lambda item: item[1][0])
    return [(token, logprob) for token, (_, logprob) in ordered]


def _version(value: Any) -> int | None:
    """A weight version as this project numbers them, or None (vLLM's own: ``"default"``)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _expand(spans: Sequence[Mapping[str, Any]], count: int) -> list[int]:
    """vLLM's ``weight_versions`` spans as one version per token."""
    versions = [0] * count
    for span in spans:
        for i in range(int(span["start"]), min(int(span["end"]), count)):
            versions[i] = int(span["version"])
    return versions
