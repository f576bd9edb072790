"""One row on SGLang's wire: its ``/generate`` request, and its streamed answer put together.

Every row is one request carrying every setting resolved (``RowSampling``), so SGLang's own
defaults never apply:

- greedy rows ask for temperature 0 (SGLang's argmax; logprobs raw, as the server runs with
  ``SGLANG_RETURN_ORIGINAL_LOGPROB``);
- sampled rows go through ``RowSampler`` (``server_side/gen_sglang_processor.py``), which makes
  the choice inside the server with the code gen-hf samples with, from a generator seeded with
  the row's seed, and sends each token's logprob and top logprobs (raw or processed) back in
  ``meta_info[CHOICE_KEY]``; SGLang's own logprobs for those rows are not used.

Stop tokens are the row's alone: SGLang gets them as ``stop_token_ids`` and starts from a copy
of the model that names no eos (``checkpoint.serving_dir``), so it stops at nothing else.
``RowStream`` also ends a row at its first stop token should a server go past one (the backend
then aborts the request by its ``rid``). Stop strings are SGLang's, kept in the output
(``no_stop_trim``). The servers stream incrementally (``--incremental-streaming-output``):
each chunk carries only its new tokens, with their logprobs and choices, so a row of ``T``
tokens costs the wire and this process ``O(T)``, where whole-row chunks cost ``O(T^2)``.
``RowStream`` puts the chunks together into the row and, at the end, a ``RowResult`` with each
token's weight version.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from gen_backend_kit import RowResult, RowSampling
from gen_backend_kit.scoring import ScoredRow
from gen_interface import GenerationError

__all__ = ["PROCESSOR", "RowStream", "batch_body", "generate_body", "score_body", "scored_row"]

#: ``RowSampler`` as SGLang's ``custom_logit_processor``: a pickle that names the class
#: (protocol 0), which the server imports from its support directory.
PROCESSOR = json.dumps({"callable": b"cgen_sglang_processor\nRowSampler\n.".hex()})
#: Where ``RowSampler`` puts each token's choice in ``meta_info`` (its ``CHOICE_KEY``).
CHOICE_KEY = "gen_sglang_choice"


def generate_body(
    prompt: Sequence[int],
    row: RowSampling,
    *,
    max_new_tokens: int,
    processed: bool,
    rid: str,
    chunk_tokens: int = 1,
) -> dict[str, Any]:
    """The streamed ``/generate`` request of one row; ``max_new_tokens`` is the row's, cut to
    what the context leaves; ``rid`` names the request (to abort it); ``chunk_tokens``: SGLang
    sends a chunk once that many of the row's tokens are unsent (and at its first token and its
    end)."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "stream_interval": chunk_tokens,
        "stop_token_ids": list(row.stop_token_ids),
        "ignore_eos": False,  # the server's model names no eos (``serving_dir``)
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if row.stop_strings:
        params["stop"] = list(row.stop_strings)
    body: dict[str, Any] = {
        "input_ids": list(prompt),
        "rid": rid,
        "return_logprob": True,
        "top_logprobs_num": row.top_logprobs,
        "stream": True,
    }
    if row.greedy:
        params["temperature"] = 0.0
    else:
        # SGLang's sampler takes the one token RowSampler allows; nothing of SGLang's own.
        params.update(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0)
        params["custom_params"] = {
            "seed": row.seed,
            "temperature": row.temperature,
            "top_k": row.top_k,
            "top_p": row.top_p,
            "min_p": row.min_p,
            "top_logprobs": row.top_logprobs,
            "processed": processed,
        }
        body["custom_logit_processor"] = PROCESSOR
        # RowSampler's logprobs come in meta_info; SGLang's own would be computed and sent
        # for nothing.
        body["return_logprob"] = False
        body["top_logprobs_num"] = 0
    body["sampling_params"] = params
    return body


def batch_body(bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``/generate`` request for several rows' bodies: each field a list, row by row (SGLang's
    batch form; a streamed answer tags each chunk with its row's ``index``)."""
    out: dict[str, Any] = {"input_ids": [b["input_ids"] for b in bodies]}
    keys = ("rid", "sampling_params", "return_logprob", "top_logprobs_num", "logprob_start_len")
    for key in keys:
        if any(key in b for b in bodies):
            out[key] = [b.get(key) for b in bodies]
    if any("custom_logit_processor" in b for b in bodies):
        out["custom_logit_processor"] = [b.get("custom_logit_processor") for b in bodies]
    if any(b.get("stream") for b in bodies):
        out["stream"] = True
    return out


def score_body(sequence: Sequence[int], prompt_length: int, top_logprobs: int) -> dict[str, Any]:
    """The request that scores ``sequence``: the logprobs of its tokens from
    ``prompt_length`` on, and nothing generated."""
    return {
        "input_ids": list(sequence),
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": prompt_length - 1,
        "top_logprobs_num": top_logprobs,
    }


def scored_row(answer: dict[str, Any], response_length: int, top_logprobs: int) -> ScoredRow:
    """A ``score_body`` answer as a ``ScoredRow``: SGLang lists the token at
    ``logprob_start_len`` first (no logprob), then each response token's."""
    meta = answer["meta_info"]
    chosen = meta["input_token_logprobs"][1:]
    tops = meta.get("input_top_logprobs") or []
    tops = tops[1:] if top_logprobs else []
    if len(chosen) != response_length:
        raise GenerationError(
            f"SGLang scored {len(chosen)} response tokens, {response_length} were sent"
        )
    per_position = [
        _top(tops[i] if i < len(tops) else None, top_logprobs) for i in range(response_length)
    ]
    return ScoredRow(
        torch.tensor([_logprob(entry[0]) for entry in chosen], dtype=torch.float32),
        torch.tensor([ids for ids, _ in per_position], dtype=torch.int64).reshape(
            response_length, top_logprobs
        ),
        torch.tensor([values for _, values in per_position], dtype=torch.float32).reshape(
            response_length, top_logprobs
        ),
    )


@dataclass
class RowStream:
    """The chunks of one row's stream, as they come.

    Attributes:
        top_logprobs: how many top logprobs the row asked for.
        stop_token_ids: the row's stop tokens: the row ends at the first (``stopped_here``).
        sampled: the row is sampled, so its choices must come from ``RowSampler``.
        token_ids, logprobs, topk_ids, topk_logprobs: the row so far.
        versions: the weight version SGLang labelled each token's chunk with.
    """

    top_logprobs: int
    stop_token_ids: frozenset[int] = frozenset()
    sampled: bool = False
    stopped_here: bool = False
    versions: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, chunk: dict[str, Any]) -> int:
        """Take one chunk (the row's new tokens, their logprobs and choices); returns how many
        tokens it added. Chunks after the row ended here (a stop token) are ignored."""
        if self.stopped_here:
            return 0
        meta = chunk.get("meta_info") or {}
        if meta.get("error"):
            raise GenerationError(f"SGLang failed the row: {meta['error']}")
        new = chunk.get("output_ids") or []
        before = len(self.token_ids)
        if new:
            logprobs, tops = _new_logprobs(meta, new, before, self.top_logprobs, self.sampled)
            self.token_ids.extend(int(t) for t in new)
            self.logprobs.extend(logprobs)
            self.versions.extend([_version(meta.get("weight_version"))] * len(new))
            if self.top_logprobs:
                self.topk_ids.extend(top_ids for top_ids, _ in tops)
                self.topk_logprobs.extend(top_values for _, top_values in tops)
        self.meta = meta
        self.finish = meta.get("finish_reason")
        stop = next((j for j, t in enumerate(new) if int(t) in self.stop_token_ids), None)
        if stop is not None:
            self._end_at(before + stop + 1)
        return len(self.token_ids) - before

    def _end_at(self, length: int) -> None:
        """End the row after its first ``length`` tokens, for a stop token."""
        for kept in (self.token_ids, self.logprobs, self.versions):
            del kept[length:]
        if self.top_logprobs:
            del self.topk_ids[length:], self.topk_logprobs[length:]
        self.finish = {"type": "stop", "matched": self.token_ids[-1]}
        self.stopped_here = True

    def result(self) -> RowResult:
        """The finished row. Raises ``GenerationError`` when SGLang ended it for no known
        reason (an error inside the server)."""
        if self.finish is None:
            raise GenerationError(
                f"SGLang's stream ended without finishing the row, after "
                f"{len(self.token_ids)} tokens"
            )
        reason = self.finish.get("type")
        if reason == "abort" and self.finish.get("message") not in (None, "Aborted"):
            reason = f"abort ({self.finish.get('message')})"  # an error, not a weight update
        # SGLang's spans, at the row's end, cover every token it generated (more than this row
        # keeps when it ran past a stop token); without them (the row ended here, not in
        # SGLang), each chunk's label, which a chunk of several tokens shares
        versions = _token_versions(self.meta.get("weight_versions"), len(self.token_ids))
        if not versions:
            versions = self.versions
        started = versions[0] if versions else _version(self.meta.get("weight_version"))
        return RowResult.ended(
            reason,
            self.token_ids,
            self.logprobs,
            weight_version=started,
            weight_versions=versions if versions and len(set(versions)) > 1 else None,
            topk_ids=self.topk_ids if self.top_logprobs else None,
            topk_logprobs=self.topk_logprobs if self.top_logprobs else None,
        )


def _new_logprobs(
    meta: dict[str, Any], new: Sequence[int], before: int, k: int, sampled: bool
) -> tuple[list[float], list[tuple[list[int], list[float]]]]:
    """The logprobs of a chunk's ``new`` tokens (the row's positions ``before`` on) and, when
    ``k``, each one's top ``k`` ids and logprobs: ``RowSampler``'s choices for a sampled row,
    SGLang's own for a greedy one. The chunk's lists hold its new tokens' entries alone."""
    end = before + len(new)
    # SGLang pads the key with None for rows the processor did not sample (greedy rows).
    entries = meta.get(CHOICE_KEY) or []
    if any(e is not None for e in entries):
        failed = next((e for e in entries if e and e[0] == "error"), None)
        if failed is not None:
            raise GenerationError(f"the row's sampler failed inside the SGLang server: {failed[1]}")
        if len(entries) != len(new) or any(
            e is None or int(e[0]) != int(t) for e, t in zip(entries, new, strict=False)
        ):
            raise GenerationError(
                f"SGLang sent tokens {list(new)} at positions {before}..{end - 1} where the "
                f"row's sampler chose {[e and e[0] for e in entries]}"
            )
        tops = [([int(i) for i in e[2]], [_logprob(v) for v in e[3]]) for e in entries]
        return [_logprob(e[1]) for e in entries], tops
    if sampled:
        raise GenerationError(
            "the SGLang server did not run the row's sampler (no choice came back for a sampled "
            "row): it must start with --enable-custom-logit-processor and this package's support "
            "directory on its PYTHONPATH, as SglangGeneration starts it"
        )
    chosen = meta.get("output_token_logprobs") or []
    if len(chosen) != len(new):
        raise GenerationError(f"SGLang sent {len(new)} new tokens with {len(chosen)} logprobs")
    tops = (meta.get("output_top_logprobs") or []) if k else []
    return [_logprob(e[0]) for e in chosen], [_top(entry, k) for entry in tops]


def _top(entry: Sequence[Any] | None, k: int) -> tuple[list[int], list[float]]:
    """The ids and logprobs of one position's SGLang top list (``[[logprob, id, text], ...]``,
    likeliest first)."""
    row = list(entry or [])[:k]
    if len(row) != k:
        raise GenerationError(f"SGLang sent {len(row)} top logprobs where {k} were asked")
    return [int(e[1]) for e in row], [_logprob(e[0]) for e in row]


def _logprob(value: float | None) -> float:
    """SGLang sends -inf (a filtered token's logprob) as null."""
    return -math.inf if value is None else float(value)


def _version(label: Any) -> int:
    """SGLang's weight version label as this project's integer (``"default"``: 0)."""
    try:
        return int(label)
    except (TypeError, ValueError):
        return 0


def _token_versions(spans: Any, count: int) -> list[int]:
    """The weight version of each of the first ``count`` tokens from SGLang's
    ``weight_versions`` spans; nothing when they cover fewer."""
    out: list[int] = []
    for span in spans or []:
        out.extend([_version(span["version"])] * (int(span["end"]) - int(span["start"])))
    return out[:count] if len(out) >= count else []
