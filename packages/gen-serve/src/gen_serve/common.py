"""What the generating routes share: a request's rows, running them, prompt scores, SSE."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import torch
from fastapi import Request
from fastapi.responses import StreamingResponse
from gen_interface import BatchedDataDict

from gen_serve.codec import IncrementalText
from gen_serve.errors import ApiError, error_body, status_of
from gen_serve.protocol import RowExtras, SamplingFields
from gen_serve.rows import RowPlan, plan_rows
from gen_serve.runner import DRAINING_MESSAGE, RETRY_DRAINING_S, RowOutcome, until_disconnected
from gen_serve.state import ServerState

__all__ = [
    "PromptScores",
    "guarded",
    "plan_for",
    "primed",
    "prompt_logprobs_json",
    "prompt_scores",
    "run_plan",
    "session_of",
    "sse",
    "sse_response",
    "text_decoder",
]

T = TypeVar("T")

#: A prompt's teacher-forced scores: per position t >= 1, (token, logprob, top ids, top logprobs).
PromptScores = list[tuple[int, float, list[int], list[float]]]


def plan_for(
    state: ServerState,
    prompts: list[list[int]],
    fields: SamplingFields,
    max_tokens: int | None,
    top_logprobs: int,
    extras: RowExtras | None = None,
    session: str | None = None,
) -> RowPlan:
    """One request's rows, with this server's ``extra_args`` applied (``RowExtras``) and the
    conversation they continue (``session``: every row carries it as its ``session_ids``)."""
    plan = _plan(state, prompts, fields, max_tokens, top_logprobs)
    if session is not None:
        plan.batch["session_ids"] = [session] * plan.rows
    if extras is None:
        return plan
    if extras.sample_seed is not None:
        if plan.rows != 1:
            raise ApiError(
                400,
                f"extra_args.sample_seed is one row's seed, and this request has {plan.rows} "
                "rows: send n=1, or use seed",
                "sampling_params.extra_args.sample_seed",
            )
        plan.batch["sample_seeds"] = torch.tensor([extras.sample_seed], dtype=torch.int64)
    return dataclasses.replace(plan, max_weight_staleness=extras.max_weight_staleness)


def _plan(
    state: ServerState,
    prompts: list[list[int]],
    fields: SamplingFields,
    max_tokens: int | None,
    top_logprobs: int,
) -> RowPlan:
    limit = state.settings.max_logprobs
    asked = max(top_logprobs, fields.prompt_logprobs or 0)
    if asked > limit:
        raise ApiError(
            400,
            f"Requested top_logprobs of {asked}, which is greater than max allowed: {limit}",
            "logprobs",
        )
    return plan_rows(
        prompts,
        fields,
        max_tokens=max_tokens,
        top_logprobs=top_logprobs,
        defaults=state.settings.defaults,
        eos_token_id=state.eos_token_id,
        context_limit=state.context_limit,
        pad_token_id=int(state.backend.config["pad_token_id"]),
        max_rows=state.settings.max_rows_per_request,
    )


def session_of(request: Request, *given: str | None) -> str | None:
    """The session a request names: its first ``session_id`` field set, else the
    ``X-Session-ID`` header."""
    return next((s for s in given if s), None) or request.headers.get("x-session-id") or None


async def run_plan(
    state: ServerState, request: Request, plan: RowPlan, request_id: str
) -> list[RowOutcome]:
    """Every row of ``plan`` to its end; a client that disconnects first ends them at once.
    Rows ended by ``/abort_requests`` answer 499; by the server's shutdown, 503."""
    work = asyncio.ensure_future(state.runner.run(plan))
    state.requests[request_id] = work
    try:
        return await until_disconnected(request.receive, work)
    except asyncio.CancelledError as exc:
        if work.cancelled() and request_id in state.requests:  # ended by the server
            if state.draining:
                raise ApiError(503, DRAINING_MESSAGE, retry_after=RETRY_DRAINING_S) from exc
            raise ApiError(499, "the request was aborted (/abort_requests)") from exc
        raise
    finally:
        state.requests.pop(request_id, None)


async def prompt_scores(state: ServerState, prompt: list[int], top_logprobs: int) -> PromptScores:
    """Teacher-forced raw logprobs of ``prompt``'s tokens after the first, with its top-k."""
    if len(prompt) < 2:
        return []
    data: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=torch.tensor([prompt]),
        prompt_lengths=torch.tensor([1]),
        unpadded_sequence_lengths=torch.tensor([len(prompt)]),
    )
    scored = await asyncio.to_thread(state.backend.score_top_logprobs, data, top_logprobs)
    return [
        (
            prompt[t],
            float(scored["logprobs"][0, t]),
            scored["topk_ids"][0, t].tolist(),
            scored["topk_logprobs"][0, t].tolist(),
        )
        for t in range(1, len(prompt))
    ]


def prompt_logprobs_json(state: ServerState, prompt: list[int], scores: PromptScores) -> list[Any]:
    """vLLM's ``prompt_logprobs``: None for the first token, then ``{token id: {logprob, rank,
    decoded_token}}`` holding the prompt token and the top ones."""
    out: list[Any] = [None] if prompt else []
    for p, (token, logprob, ids, lps) in enumerate(scores, start=1):
        context = prompt[max(1, p - 4) : p]  # vLLM's: the scored prompt tokens before
        entry = {str(token): _logprob_entry(state, token, logprob, ids, context)}
        for t, lp in zip(ids, lps):
            entry.setdefault(str(t), _logprob_entry(state, t, lp, ids, context))
        out.append(entry)
    return out


def _logprob_entry(
    state: ServerState, token: int, logprob: float, ids: list[int], context: list[int]
) -> Any:
    return {
        "logprob": max(logprob, -9999.0),
        "rank": ids.index(token) + 1 if token in ids else None,
        "decoded_token": state.codec.logprob_text(token, context) if state.codec else None,
    }


async def primed(items: AsyncIterator[T]) -> AsyncIterator[T]:
    """``items`` with its first item already awaited, so that a call the backend refuses
    raises here (an HTTP error) rather than inside a stream that already answered 200."""
    iterator = aiter(items)
    try:
        first = await anext(iterator)
    except StopAsyncIteration:
        return _empty()

    async def rest() -> AsyncIterator[T]:
        try:
            yield first
            async for item in iterator:
                yield item
        finally:
            await iterator.aclose()  # type: ignore[attr-defined]

    return rest()


async def _empty() -> AsyncIterator[Any]:
    return
    yield


def text_decoder(state: ServerState, fields: SamplingFields) -> IncrementalText | None:
    """A row's streamed text under ``fields``' rules; None without a tokenizer."""
    if state.codec is None:
        return None
    return IncrementalText(
        state.codec,
        skip_special_tokens=fields.skip_special_tokens,
        stop_strings=fields.stop_strings,
        include_stop=fields.include_stop_str_in_output,
    )


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


async def guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Errors after the headers went out travel in the stream, then ``[DONE]`` (vLLM's way)."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        yield f"data: {json.dumps(error_body(status_of(exc), str(exc), exc=exc))}\n\n"
    yield "data: [DONE]\n\n"
