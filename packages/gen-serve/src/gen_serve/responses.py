"""Response bodies in vLLM's shapes: choices, the three logprob formats, usage, weight versions.

Logprob entries list the chosen token first, then the likeliest others, as vLLM's engine does;
``-inf`` is sent as -9999.0. Token strings are the token's own text, or ``"token_id:N"`` when the
request asks for ``return_tokens_as_token_ids``.
"""

from __future__ import annotations

import base64
import io
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from gen_serve.codec import TextCodec
from gen_serve.runner import RowOutcome

__all__ = [
    "chat_logprobs",
    "completion_logprobs",
    "created",
    "generate_logprobs",
    "new_id",
    "ranked",
    "routed_experts_b64",
    "row_text",
    "token_string",
    "usage",
    "weight_version_spans",
]


def new_id(prefix: str, given: str | None = None) -> str:
    return f"{prefix}-{given or uuid.uuid4().hex[:16]}"


def created() -> int:
    return int(time.time())


def clamp(logprob: float) -> float:
    return max(logprob, -9999.0) if not math.isnan(logprob) else -9999.0


def token_string(
    codec: TextCodec | None, token: int, as_ids: bool, context: Sequence[int] = ()
) -> str:
    """A logprob entry's token: ``"token_id:N"``, or its text after the sampled tokens
    ``context`` (``TextCodec.logprob_text``)."""
    if as_ids or codec is None:
        return f"token_id:{token}"
    return codec.logprob_text(token, context)


def _context(tokens: Sequence[int], position: int) -> Sequence[int]:
    """The sampled tokens before ``position`` that can complete its character's bytes."""
    return tokens[max(0, position - 4) : position]


def ranked(
    token: int, logprob: float, top_ids: Sequence[int], top_logprobs: Sequence[float]
) -> list[tuple[int, float, int | None]]:
    """``(token, logprob, rank)`` entries: the chosen token first, then the top ones not it.
    Ranks count from 1 among the top ones; the chosen token's is None when it is not there."""
    entries: list[tuple[int, float, int | None]] = []
    rank = top_ids.index(token) + 1 if token in top_ids else None
    entries.append((token, clamp(logprob), rank))
    for r, (t, lp) in enumerate(zip(top_ids, top_logprobs), start=1):
        if t != token:
            entries.append((t, clamp(lp), r))
    return entries


def completion_logprobs(
    codec: TextCodec | None,
    outcome: RowOutcome,
    *,
    as_ids: bool,
    start: int = 0,
    offset: int = 0,
    prompt: Sequence[tuple[int, float | None, Sequence[int], Sequence[float]]] = (),
) -> dict[str, Any]:
    """vLLM's ``CompletionLogProbs`` of tokens ``start:`` of ``outcome`` (after ``prompt``'s
    entries when echoing: ``(token, logprob or None for the first, top ids, top logprobs)``)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    scored_prompt = [step[0] for step in prompt[1:]]  # vLLM's context for prompt positions
    steps = [
        (step, _context(scored_prompt, p - 1) if p else ()) for p, step in enumerate(prompt)
    ] + [
        ((t, lp, ids, lps), _context(outcome.token_ids, start + j))
        for j, (t, lp, ids, lps) in enumerate(
            zip(
                outcome.token_ids[start:],
                outcome.logprobs[start:],
                outcome.topk_ids[start:],
                outcome.topk_logprobs[start:],
            )
        )
    ]
    for (token, logprob, ids, lps), context in steps:
        tokens.append(token_string(codec, token, as_ids, context))
        if logprob is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(clamp(logprob))
        top.append(
            {
                token_string(codec, t, as_ids, context): lp
                for t, lp, _ in ranked(token, logprob, ids, lps)
            }
        )
    offsets = []
    for piece in tokens:
        offsets.append(offset)
        offset += len(piece)
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top,
    }


def chat_logprobs(
    codec: TextCodec | None, outcome: RowOutcome, *, top_k: int, as_ids: bool, start: int = 0
) -> dict[str, Any]:
    """vLLM's ``ChatCompletionLogProbs``: ``top_logprobs`` are the first ``top_k`` entries of
    ``ranked`` (the chosen token first)."""
    content = []
    for j, (token, logprob, ids, lps) in enumerate(
        zip(
            outcome.token_ids[start:],
            outcome.logprobs[start:],
            outcome.topk_ids[start:],
            outcome.topk_logprobs[start:],
        )
    ):
        context = _context(outcome.token_ids, start + j)
        entries = ranked(token, logprob, ids, lps)[:top_k]
        content.append(
            {
                **_chat_token(codec, token, as_ids, context, chosen=True),
                "logprob": clamp(logprob),
                "top_logprobs": [
                    {**_chat_token(codec, t, as_ids, context, chosen=False), "logprob": lp}
                    for t, lp, _ in entries
                ],
            }
        )
    return {"content": content}


def _chat_token(
    codec: TextCodec | None, token: int, as_ids: bool, context: Sequence[int], *, chosen: bool
) -> dict[str, Any]:
    """A chat logprob entry's ``token`` and ``bytes``, as vLLM fills them: a chosen token's
    bytes are of its text even when ``token`` is ``"token_id:N"`` (None without a tokenizer);
    a top entry's are of its ``token``."""
    text = token_string(codec, token, as_ids, context)
    if chosen and codec is None:
        return {"token": text, "bytes": None}
    shown = codec.logprob_text(token, context) if chosen and as_ids and codec else text
    return {"token": text, "bytes": list(shown.encode("utf-8", errors="replace"))}


def generate_logprobs(outcome: RowOutcome, *, top_k: int, start: int = 0) -> dict[str, Any]:
    """The token route's logprobs: ``{token_id, logprob, rank, top_logprobs}`` per token, with
    the first ``max(top_k, 1)`` ranked entries."""
    content = []
    for token, logprob, ids, lps in zip(
        outcome.token_ids[start:],
        outcome.logprobs[start:],
        outcome.topk_ids[start:],
        outcome.topk_logprobs[start:],
    ):
        entries = ranked(token, logprob, ids, lps)
        content.append(
            {
                "token_id": token,
                "logprob": entries[0][1],
                "rank": entries[0][2],
                "top_logprobs": [
                    {"token_id": t, "logprob": lp, "rank": r}
                    for t, lp, r in entries[: max(top_k, 1)]
                ],
            }
        )
    return {"content": content}


def row_text(
    codec: TextCodec | None,
    outcome: RowOutcome,
    *,
    skip_special_tokens: bool,
    include_stop_str: bool,
) -> str:
    """A row's text; a stop string that ended it is cut off unless asked for."""
    if codec is None:
        return ""
    text = codec.decode(outcome.token_ids, skip_special_tokens=skip_special_tokens)
    stop = outcome.stop_reason
    if isinstance(stop, str) and not include_stop_str:
        at = text.find(stop)
        if at >= 0:
            text = text[:at]
    return text


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def weight_version_spans(versions: Sequence[int]) -> list[dict[str, Any]]:
    """vLLM's ``weight_versions`` spans: ``[{"version", "start", "end"}]`` over output tokens."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(version), "start": i, "end": i + 1})
    return spans


def routed_experts_b64(routing: np.ndarray) -> str:
    """A row's routed experts as vLLM's token route sends them: base64 of the ``.npy`` bytes of
    ``[positions, layers, top_k]``, uint8 while every id fits, else uint16 (decode:
    ``np.load(io.BytesIO(base64.b64decode(s)))``)."""
    compact = routing.astype(np.uint8 if routing.size == 0 or routing.max() < 256 else np.uint16)
    with io.BytesIO() as buffer:
        np.save(buffer, compact, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")
