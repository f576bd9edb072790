"""vLLM's token-in, token-out route (``/inference/v1/generate``), ``/tokenize`` and
``/detokenize``. The generate route is always on here (vLLM mounts it with
``--enable-scale-out``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gen_serve.common import (
    guarded,
    plan_for,
    primed,
    prompt_logprobs_json,
    prompt_scores,
    run_plan,
    session_of,
    sse,
    text_decoder,
)
from gen_serve.errors import ApiError
from gen_serve.protocol import (
    DetokenizeRequest,
    GenerateRequest,
    GenerateSampling,
    TokenizeRequest,
)
from gen_serve.responses import (
    chat_logprobs,
    created,
    generate_logprobs,
    new_id,
    routed_experts_b64,
    row_text,
    weight_version_spans,
)
from gen_serve.rows import RowPlan
from gen_serve.runner import RowOutcome
from gen_serve.state import ServerState, parse_body

__all__ = ["token_router"]


def token_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/inference/v1/generate")
    async def generate(request: Request) -> Any:
        req = await parse_body(request, GenerateRequest)
        state.check_model(req.model)
        params = req.sampling()
        if req.output_mode == "text":
            state.require_codec("output_mode 'text'")
        plan = plan_for(
            state,
            [req.token_ids],
            params,
            params.max_tokens,
            params.logprobs or 0,
            params.extras(),
            session_of(request, req.session_id, params.session_id),
        )
        rid = new_id("generate-tokens", request.headers.get("x-request-id") or req.request_id)
        if req.stream:
            steps = await primed(state.runner.stream(plan))
            return StreamingResponse(
                guarded(_generate_stream(state, req, plan, rid, steps)),
                media_type="text/event-stream",
            )
        outcomes = await run_plan(state, request, plan, rid)
        scores = []
        if params.prompt_logprobs is not None:
            scores = await prompt_scores(state, req.token_ids, max(params.prompt_logprobs, 0))
        completion = sum(len(o.token_ids) for o in outcomes)
        return JSONResponse(
            {
                "request_id": rid,
                "model": state.settings.model_name,
                "created": created(),
                "usage": {
                    "prompt_tokens": len(req.token_ids),
                    "total_tokens": len(req.token_ids) + completion,
                    "completion_tokens": completion,
                    "prompt_tokens_details": None,
                    "completion_tokens_details": None,
                },
                "prompt_logprobs": prompt_logprobs_json(state, req.token_ids, scores)
                if params.prompt_logprobs is not None
                else None,
                "prompt_token_id_logprobs": None,
                "prompt_token_ids": req.token_ids if req.return_token_ids else None,
                "mm_placeholders": None,
                "metrics": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "output_mode": req.output_mode,
                "choices": [
                    _generate_choice(state, req, row, outcome, final=True)
                    for row, outcome in enumerate(outcomes)
                ],
            }
        )

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        req = await parse_body(request, TokenizeRequest)
        state.check_model(req.model)
        codec = state.require_codec("tokenize")
        if req.messages is not None:
            from gen_serve.codec import ChatTemplateError

            try:
                text = codec.render_chat(
                    req.messages,
                    tools=req.tools,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    extra=req.chat_template_kwargs,
                )
            except ChatTemplateError as exc:
                raise ApiError(400, str(exc), "messages") from exc
            add = bool(req.add_special_tokens) if req.add_special_tokens is not None else False
        else:
            text = req.prompt or ""
            add = req.add_special_tokens if req.add_special_tokens is not None else True
        tokens = codec.encode(text, add_special_tokens=add)
        return {
            "count": len(tokens),
            "max_model_len": state.context_limit,
            "tokens": tokens,
            "token_strs": [codec.token_piece(t) for t in tokens] if req.return_token_strs else None,
        }

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        req = await parse_body(request, DetokenizeRequest)
        state.check_model(req.model)
        codec = state.require_codec("detokenize")
        bad = [t for t in req.tokens if not 0 <= t < codec.vocab_size]
        if bad:
            raise ApiError(400, f"Token id {bad[0]} is out of vocabulary", "tokens")
        return {"prompt": codec.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)}

    return router


def _generate_choice(
    state: ServerState,
    req: GenerateRequest,
    row: int,
    outcome: RowOutcome,
    *,
    final: bool,
    start: int = 0,
    text: str | None = None,
    params: GenerateSampling | None = None,
) -> dict[str, Any]:
    """Row ``row``'s choice with its tokens from ``start`` (a stream's new ones); ``text`` is
    their text when streamed (else the row's text is decoded whole). ``params``: the request's
    sampling, already read (a stream reads it once, not per chunk)."""
    params = params if params is not None else req.sampling()
    choice: dict[str, Any] = {
        "index": row,
        "finish_reason": outcome.finish_reason if final else None,
        "stop_reason": outcome.stop_reason if final else None,
        "token_ids": outcome.token_ids[start:],
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": weight_version_spans(outcome.weight_versions) if final else None,
    }
    if req.output_mode == "text":
        choice["text"] = (
            text
            if text is not None
            else row_text(
                state.codec,
                outcome,
                skip_special_tokens=params.skip_special_tokens,
                include_stop_str=params.include_stop_str_in_output,
            )
        )
    if params.logprobs is None:
        choice["logprobs"] = None
    elif req.output_mode == "text":
        choice["logprobs"] = chat_logprobs(
            state.codec, outcome, top_k=max(params.logprobs, 1), as_ids=False, start=start
        )
    else:
        choice["logprobs"] = generate_logprobs(outcome, top_k=params.logprobs, start=start)
    if final:
        choice["weight_version"] = outcome.weight_version
        if outcome.routed_experts is not None:
            start = params.routed_experts_prompt_start
            choice["routed_experts"] = routed_experts_b64(outcome.routed_experts[start:])
    return choice


async def _generate_stream(
    state: ServerState,
    req: GenerateRequest,
    plan: RowPlan,
    rid: str,
    steps: AsyncIterator[Any],
) -> AsyncIterator[str]:
    params = req.sampling()
    decoders = [
        text_decoder(state, params) if req.output_mode == "text" else None for _ in range(plan.rows)
    ]
    sent_prompt = False
    generated = 0
    async for step in steps:
        event, outcome = step.event, step.outcome
        if not event.token_ids and not event.finished:
            continue
        generated += len(event.token_ids)
        decoder = decoders[step.row]
        text = decoder.add(event.token_ids, final=event.finished) if decoder else None
        chunk: dict[str, Any] = {"request_id": rid, "usage": None}
        if req.return_token_ids and not sent_prompt:
            chunk["prompt_token_ids"] = plan.prompts[0]
            sent_prompt = True
        chunk["output_mode"] = req.output_mode
        chunk["choices"] = [
            _generate_choice(
                state,
                req,
                step.row,
                outcome,
                final=event.finished,
                start=len(outcome.token_ids) - len(event.token_ids),
                text=text,
                params=params,
            )
        ]
        yield sse(chunk)
    options = req.stream_options
    if options is not None and options.include_usage:
        p = len(plan.prompts[0])
        counts = {"prompt_tokens": p, "total_tokens": p + generated, "completion_tokens": generated}
        yield sse(
            {"request_id": rid, "usage": counts, "output_mode": req.output_mode, "choices": []}
        )
