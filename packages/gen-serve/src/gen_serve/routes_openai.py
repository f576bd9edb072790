"""``/v1/completions`` and ``/v1/chat/completions``, in vLLM's shapes (with its extensions:
``return_token_ids``, ``return_tokens_as_token_ids``, ``prompt_logprobs``, ``top_k``, ...), plus
each choice's ``weight_version`` (and, asked with ``return_weight_versions``, per token)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gen_serve.codec import ChatTemplateError
from gen_serve.common import (
    PromptScores,
    guarded,
    plan_for,
    primed,
    prompt_logprobs_json,
    prompt_scores,
    run_plan,
    session_of,
    sse,
    sse_response,
    text_decoder,
)
from gen_serve.errors import ApiError
from gen_serve.protocol import ChatRequest, CompletionRequest, StreamOptions
from gen_serve.responses import (
    chat_logprobs,
    completion_logprobs,
    created,
    new_id,
    row_text,
    usage,
)
from gen_serve.rows import RowPlan
from gen_serve.runner import RowOutcome
from gen_serve.state import ServerState, parse_body

__all__ = ["openai_router"]


def openai_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req = await parse_body(request, CompletionRequest)
        state.check_model(req.model)
        prompts, texts = _completion_prompts(state, req)
        plan = plan_for(
            state,
            prompts,
            req,
            req.max_tokens,
            req.logprobs or 0,
            session=session_of(request, req.session_id),
        )
        want_prompt = req.prompt_logprobs is not None or (req.echo and req.logprobs is not None)
        k_prompt = max(req.prompt_logprobs or 0, req.logprobs or 0 if req.echo else 0)
        rid = new_id("cmpl", request.headers.get("x-request-id") or req.request_id)
        head = {"id": rid, "object": "text_completion", "created": created(), "model": _name(state)}
        if req.stream:
            return sse_response(await _stream_completion(state, req, plan, texts, head))
        outcomes = await run_plan(state, request, plan, rid)
        scores = [await prompt_scores(state, p, k_prompt) for p in prompts] if want_prompt else []
        choices = [
            _completion_choice(state, req, plan, row, outcomes[row], texts, scores)
            for row in range(plan.rows)
        ]
        return JSONResponse(
            {
                **head,
                "choices": choices,
                "service_tier": None,
                "system_fingerprint": state.fingerprint,
                "usage": usage(
                    sum(len(p) for p in prompts), sum(len(o.token_ids) for o in outcomes)
                ),
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        )

    @router.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        req = await parse_body(request, ChatRequest)
        state.check_model(req.model)
        prompt = _chat_prompt(state, req)
        k = (req.top_logprobs or 0) if req.logprobs else 0
        plan = plan_for(
            state, [prompt], req, req.new_tokens, k, session=session_of(request, req.session_id)
        )
        rid = new_id("chatcmpl", request.headers.get("x-request-id") or req.request_id)
        head = {"id": rid, "created": created(), "model": _name(state)}
        if req.stream:
            return sse_response(await _stream_chat(state, req, plan, head))
        outcomes = await run_plan(state, request, plan, rid)
        scores = await prompt_scores(state, prompt, req.prompt_logprobs or 0)
        choices = [_chat_choice(state, req, row, outcomes[row]) for row in range(plan.rows)]
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": head["created"],
                "model": head["model"],
                "choices": choices,
                "service_tier": None,
                "system_fingerprint": state.fingerprint,
                "usage": usage(len(prompt), sum(len(o.token_ids) for o in outcomes)),
                "prompt_logprobs": prompt_logprobs_json(state, prompt, scores)
                if req.prompt_logprobs is not None
                else None,
                "prompt_token_ids": prompt if req.return_token_ids else None,
                "prompt_text": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        )

    return router


# ---- shared by the routes ---------------------------------------------------------------------


def _name(state: ServerState) -> str:
    return state.settings.model_name


def _versions(req: CompletionRequest | ChatRequest, outcome: RowOutcome) -> dict[str, Any]:
    """A finished choice's ``weight_version``, and its per-token ``weight_versions`` if asked."""
    versions: dict[str, Any] = {"weight_version": outcome.weight_version}
    if req.return_weight_versions:
        versions["weight_versions"] = outcome.weight_versions
    return versions


def _with_usage(options: StreamOptions | None) -> bool:
    return options is not None and bool(options.include_usage)


def _usage_chunk(state: ServerState, head: dict[str, Any], p: int, c: int) -> str:
    """A stream's last chunk when usage is asked for (it then carries the fingerprint)."""
    counts = {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}
    return sse({**head, "choices": [], "usage": counts, "system_fingerprint": state.fingerprint})


def _stamped(state: ServerState, chunk: dict[str, Any], last: bool) -> dict[str, Any]:
    """vLLM stamps the fingerprint on a row's finishing chunk when no usage chunk follows."""
    return {**chunk, "system_fingerprint": state.fingerprint} if last else chunk


# ---- completions --------------------------------------------------------------------------------


def _completion_prompts(
    state: ServerState, req: CompletionRequest
) -> tuple[list[list[int]], list[str | None]]:
    """Each prompt's ids, and its text when it came as text."""
    given: Any = req.prompt
    items: list[Any] = [given] if isinstance(given, str) else list(given or [])
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]], [None]  # one prompt of token ids
    ids: list[list[int]] = []
    texts: list[str | None] = []
    for item in items:
        if isinstance(item, str):
            codec = state.require_codec("a text prompt")
            ids.append(codec.encode(item, add_special_tokens=req.add_special_tokens))
            texts.append(item)
        else:
            ids.append([int(t) for t in item])
            texts.append(None)
    return ids, texts


def _prompt_text(state: ServerState, texts: Sequence[str | None], plan: RowPlan, i: int) -> str:
    """Prompt ``i`` as text: as it came, or decoded from its ids."""
    given = texts[i]
    if given is not None:
        return given
    return state.codec.decode(plan.prompts[i]) if state.codec else ""


def _completion_choice(
    state: ServerState,
    req: CompletionRequest,
    plan: RowPlan,
    row: int,
    outcome: RowOutcome,
    texts: Sequence[str | None],
    scores: Sequence[PromptScores],
) -> dict[str, Any]:
    codec = state.codec
    i = plan.prompt_of(row)
    prompt = plan.prompts[i]
    text = row_text(
        codec,
        outcome,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str=req.include_stop_str_in_output,
    )
    as_ids = bool(req.return_tokens_as_token_ids)
    logprobs = None
    if req.echo:  # vLLM leaves the prompt out of the text when it returns token ids
        text = ("" if req.return_token_ids else _prompt_text(state, texts, plan, i)) + text
    if req.logprobs is not None:
        echoed: list[tuple[int, float | None, list[int], list[float]]] = []
        if req.echo:
            echoed = [(prompt[0], None, [], []), *(scores[i] if scores else [])]
        logprobs = completion_logprobs(codec, outcome, as_ids=as_ids, prompt=echoed)
    choice: dict[str, Any] = {
        "index": row,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": outcome.finish_reason,
        "stop_reason": outcome.stop_reason,
        "token_ids": outcome.token_ids if req.return_token_ids else None,
        "prompt_logprobs": prompt_logprobs_json(state, prompt, scores[i])
        if req.prompt_logprobs is not None and scores
        else None,
        "prompt_token_ids": prompt if req.return_token_ids else None,
        "routed_experts": None,
        **_versions(req, outcome),
    }
    return choice


async def _stream_completion(
    state: ServerState,
    req: CompletionRequest,
    plan: RowPlan,
    texts: Sequence[str | None],
    head: dict[str, Any],
) -> AsyncIterator[str]:
    steps = await primed(state.runner.stream(plan))

    async def events() -> AsyncIterator[str]:
        codec = state.codec
        decoders = [text_decoder(state, req) for _ in range(plan.rows)]
        started = [False] * plan.rows
        offsets = [0] * plan.rows
        as_ids = bool(req.return_tokens_as_token_ids)
        usage = _with_usage(req.stream_options)
        generated = 0
        async for step in steps:
            row, event, outcome = step.row, step.event, step.outcome
            decoder = decoders[row]
            delta = decoder.add(event.token_ids, final=event.finished) if decoder else ""
            first = not started[row]
            if first and req.echo:
                delta = _prompt_text(state, texts, plan, plan.prompt_of(row)) + delta
            if not event.token_ids and not event.finished and not first:
                continue
            started[row] = True
            generated += len(event.token_ids)
            logprobs = None
            if req.logprobs is not None:
                start = len(outcome.token_ids) - len(event.token_ids)
                logprobs = completion_logprobs(
                    codec, outcome, as_ids=as_ids, start=start, offset=offsets[row]
                )
                offsets[row] += sum(len(t) for t in logprobs["tokens"])
            choice = {
                "index": row,
                "text": delta,
                "logprobs": logprobs,
                "finish_reason": outcome.finish_reason if event.finished else None,
                "stop_reason": outcome.stop_reason if event.finished else None,
                "prompt_token_ids": plan.prompts[plan.prompt_of(row)]
                if first and req.return_token_ids
                else None,
                "token_ids": event.token_ids if req.return_token_ids else None,
            }
            if event.finished:
                choice.update(_versions(req, outcome))
            yield sse(_stamped(state, {**head, "choices": [choice]}, event.finished and not usage))
        if usage:
            yield _usage_chunk(state, head, sum(len(p) for p in plan.prompts), generated)

    return guarded(events())


# ---- chat ---------------------------------------------------------------------------------------


def _chat_prompt(state: ServerState, req: ChatRequest) -> list[int]:
    codec = state.require_codec("chat")
    messages = [
        dict(m, content=_content_text(m.get("content"), i)) for i, m in enumerate(req.messages)
    ]
    try:
        text = codec.render_chat(
            messages,
            tools=req.tools,
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message,
            extra=req.chat_template_kwargs,
        )
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), "messages") from exc
    return codec.encode(text, add_special_tokens=req.add_special_tokens)


def _content_text(content: Any, index: int) -> str:
    """A message's text: a string, or text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(
                    400, f"messages[{index}]: content part {kind!r} is not supported (text only)"
                )
            parts.append(str(part.get("text", "")))
        return "\n".join(parts)
    raise ApiError(400, f"messages[{index}].content must be a string or a list of parts")


def _chat_choice(
    state: ServerState, req: ChatRequest, row: int, outcome: RowOutcome
) -> dict[str, Any]:
    text = row_text(
        state.codec,
        outcome,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str=req.include_stop_str_in_output,
    )
    choice: dict[str, Any] = {
        "index": row,
        "message": {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        },
        "logprobs": chat_logprobs(
            state.codec,
            outcome,
            top_k=req.top_logprobs or 0,
            as_ids=bool(req.return_tokens_as_token_ids),
        )
        if req.logprobs
        else None,
        "finish_reason": outcome.finish_reason,
        "stop_reason": outcome.stop_reason,
        "token_ids": outcome.token_ids if req.return_token_ids else None,
        "routed_experts": None,
        **_versions(req, outcome),
    }
    return choice


async def _stream_chat(
    state: ServerState, req: ChatRequest, plan: RowPlan, head: dict[str, Any]
) -> AsyncIterator[str]:
    base = {**head, "object": "chat.completion.chunk"}
    steps = await primed(state.runner.stream(plan))

    async def events() -> AsyncIterator[str]:
        prompt = plan.prompts[0]
        for row in range(plan.rows):
            yield sse(
                {
                    **base,
                    "choices": [
                        {
                            "index": row,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    "prompt_token_ids": prompt if req.return_token_ids else None,
                    "prompt_text": None,
                }
            )
        decoders = [text_decoder(state, req) for _ in range(plan.rows)]
        usage = _with_usage(req.stream_options)
        generated = 0
        async for step in steps:
            row, event, outcome = step.row, step.event, step.outcome
            decoder = decoders[row]
            delta = decoder.add(event.token_ids, final=event.finished) if decoder else ""
            if not event.token_ids and not event.finished:
                continue
            generated += len(event.token_ids)
            choice: dict[str, Any] = {
                "index": row,
                "delta": {"content": delta},
                "logprobs": chat_logprobs(
                    state.codec,
                    outcome,
                    top_k=req.top_logprobs or 0,
                    as_ids=bool(req.return_tokens_as_token_ids),
                    start=len(outcome.token_ids) - len(event.token_ids),
                )
                if req.logprobs
                else None,
                "finish_reason": outcome.finish_reason if event.finished else None,
                "token_ids": event.token_ids if req.return_token_ids else None,
            }
            if event.finished:
                choice["stop_reason"] = outcome.stop_reason
                choice.update(_versions(req, outcome))
            yield sse(_stamped(state, {**base, "choices": [choice]}, event.finished and not usage))
        if usage:
            yield _usage_chunk(state, base, len(prompt), generated)

    return guarded(events())
