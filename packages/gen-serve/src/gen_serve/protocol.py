"""The request bodies the server accepts, field for field with vLLM's where they exist.

Unknown fields are refused (400) with the closest known one. vLLM's own fields that this server
does not implement are accepted while their value changes nothing (the defaults vLLM uses:
penalties off, no logit bias, no beam search, ...) and refused with the reason otherwise, so a
client written for vLLM runs unchanged or learns at once what differs, never silently.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gen_serve.errors import ApiError

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "GenerateRequest",
    "RowExtras",
    "SamplingFields",
    "StreamOptions",
    "TokenizeRequest",
]


def _off(value: Any) -> bool:
    return value in (None, False, 0, 0.0, "", [], {})


#: vLLM fields accepted while inert: name -> (is this value inert?, why a live value is refused).
_INERT: dict[str, tuple[Any, str]] = {
    "presence_penalty": (_off, "penalties are not supported: they change the sampled distribution"),
    "frequency_penalty": (_off, "penalties are not supported"),
    "repetition_penalty": (lambda v: v in (None, 1, 1.0), "penalties are not supported"),
    "logit_bias": (_off, "logit_bias is not supported"),
    "use_beam_search": (_off, "beam search is not supported"),
    "length_penalty": (lambda v: v in (None, 1, 1.0), "beam search is not supported"),
    "bad_words": (_off, "bad_words is not supported: penalise those words in the reward"),
    "allowed_token_ids": (_off, "allowed_token_ids is not supported"),
    "truncate_prompt_tokens": (_off, "prompt truncation is not supported: send a shorter prompt"),
    "truncation_side": (lambda v: True, ""),
    "min_tokens": (_off, "min_tokens is not supported"),
    "response_format": (
        lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
        "structured output (response_format) is not supported",
    ),
    "structured_outputs": (_off, "structured outputs are not supported"),
    "guided_json": (_off, "structured outputs are not supported"),
    "guided_regex": (_off, "structured outputs are not supported"),
    "guided_choice": (_off, "structured outputs are not supported"),
    "suffix": (_off, "suffix (fill in the middle) is not supported"),
    "watermarking": (_off, "watermarking is not supported"),
    "thinking_token_budget": (lambda v: v in (None, -1), "thinking_token_budget is not supported"),
    "repetition_detection": (_off, "repetition detection is not supported"),
    "logprob_token_ids": (_off, "logprob_token_ids is not supported: use logprobs"),
    "prompt_embeds": (_off, "prompt_embeds is not supported: send token ids"),
    "kv_transfer_params": (_off, "KV transfer is not supported"),
    "ec_transfer_params": (_off, "KV transfer is not supported"),
    "spaces_between_special_tokens": (lambda v: True, ""),
    "priority": (lambda v: True, ""),
    "cache_salt": (lambda v: True, ""),
    "user": (lambda v: True, ""),
    "vllm_xargs": (_off, "vllm_xargs is not supported"),
    "return_token_offsets": (_off, "return_token_offsets is not supported"),
    "routed_experts_prompt_start": (lambda v: True, ""),
    "stream_interval": (lambda v: True, ""),
    "mm_payload": (lambda v: True, ""),
    "return_mm_kwargs": (_off, "multimodal inputs are not supported"),
    "parallel_tool_calls": (lambda v: True, ""),
    "reasoning_effort": (lambda v: True, ""),
    "include_reasoning": (lambda v: True, ""),
    "documents": (_off, "documents are not supported"),
    "chat_template": (_off, "a request's own chat_template is not accepted: the model's is used"),
    "media_io_kwargs": (_off, "multimodal inputs are not supported"),
    "mm_processor_kwargs": (_off, "multimodal inputs are not supported"),
    "return_prompt_text": (_off, "return_prompt_text is not supported"),
    "features": (_off, "multimodal features are not supported"),
    "content_parts": (_off, "multimodal inputs are not supported"),
    "token_offsets": (_off, "token_offsets are not supported"),
    "reasoning_ended": (lambda v: True, ""),
    "reasoning_parser_kwargs": (lambda v: True, ""),
    "service_tier": (lambda v: True, ""),
    "store": (_off, "stored completions are not supported"),
    "metadata": (lambda v: True, ""),
    "modalities": (lambda v: v in (None, ["text"]), "only text output is supported"),
    "audio": (_off, "audio is not supported"),
    "prediction": (_off, "predicted outputs are not supported"),
    "web_search_options": (_off, "web search is not supported"),
    "function_call": (_off, "the functions API is retired: use tools"),
    "functions": (_off, "the functions API is retired: use tools"),
    "max_num_tokens": (lambda v: True, ""),
}


class _Strict(BaseModel):
    """Refuses unknown fields (with a suggestion) and vLLM's live fields it lacks (with why)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @model_validator(mode="after")
    def _check_extras(self) -> _Strict:
        for name, value in (self.model_extra or {}).items():
            if name in _INERT:
                inert, why = _INERT[name]
                if not inert(value):
                    raise ApiError(400, f"`{name}` = {value!r} is not supported here: {why}", name)
                continue
            known = sorted(set(type(self).model_fields) | set(_INERT))
            near = difflib.get_close_matches(name, known, 1, 0.75)
            hint = f"; did you mean `{near[0]}`?" if near else ""
            raise ApiError(400, f"unknown field `{name}`{hint}", name)
        return self


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(_Strict):
    """What every generating route takes (vLLM's names and defaults)."""

    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=-1)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    #: This server's: every choice's per-token weight versions (int list).
    return_weight_versions: bool = False
    #: The conversation this request continues: its rows go to the replica that served the
    #: session's last request while that replica's load allows (also the ``X-Session-ID``
    #: header).
    session_id: str | None = Field(None, min_length=1)
    request_id: str | None = None
    model: str | None = None

    @model_validator(mode="after")
    def _check_sampling(self) -> SamplingFields:
        if (isinstance(self.stop, list) and any(not s for s in self.stop)) or self.stop == "":
            raise ApiError(400, "stop cannot contain an empty string", "stop")
        if any(t < 0 for t in self.stop_token_ids or []):
            raise ApiError(400, "stop_token_ids must be token ids (>= 0)", "stop_token_ids")
        greedy = self.temperature is not None and self.temperature < 1e-5
        if greedy and self.n > 1:
            raise ApiError(400, f"n must be 1 when using greedy sampling, got {self.n}", "n")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        _check_stream(self.stream, self.stream_options, self.prompt_logprobs)
        if self.prompt is None or self.prompt == "" or self.prompt == []:
            raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty.")
        return self


class ChatRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False

    @model_validator(mode="after")
    def _check_chat(self) -> ChatRequest:
        _check_stream(self.stream, self.stream_options, self.prompt_logprobs)
        if self.top_logprobs and not self.logprobs:
            raise ApiError(
                400, "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )
        both = "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt
        if self.continue_final_message and both:
            raise ApiError(
                400,
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            )
        if self.tools == []:
            raise ApiError(400, "`tools` must not be an empty array", "tools")
        choice = self.tool_choice
        if choice not in (None, "none", "auto"):
            raise ApiError(
                400,
                f"tool_choice {choice!r} is not supported: tool definitions reach the chat "
                "template, but calls are not parsed or forced; use 'auto' or 'none'",
                "tool_choice",
            )
        for i, message in enumerate(self.messages):
            if not isinstance(message.get("role"), str):
                raise ApiError(400, f"messages[{i}] needs a string `role`", "messages")
        return self

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class GenerateRequest(_Strict):
    """``POST /inference/v1/generate``: vLLM's token-in, token-out route."""

    token_ids: list[int] = Field(..., min_length=1)
    sampling_params: dict[str, Any]
    request_id: str | None = None
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    session_id: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _check_ids(self) -> GenerateRequest:
        if any(t < 0 for t in self.token_ids):
            raise ApiError(400, "token_ids must be >= 0", "token_ids")
        return self

    def sampling(self) -> GenerateSampling:
        """The ``sampling_params`` object, checked (vLLM's ``SamplingParams`` names)."""
        try:
            return GenerateSampling.model_validate(self.sampling_params)
        except ApiError as exc:
            exc.param = f"sampling_params.{exc.param}" if exc.param else "sampling_params"
            raise
        except ValueError as exc:
            raise ApiError(400, f"sampling_params: {exc}", "sampling_params") from exc


class GenerateSampling(SamplingFields):
    """vLLM's ``SamplingParams`` fields, as ``/inference/v1/generate`` takes them."""

    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0)
    detokenize: bool = True
    output_kind: Any = None
    extra_args: dict[str, Any] | None = None
    flat_logprobs: bool = False
    # routed experts leave out this many leading prompt positions (a later turn of a
    # conversation asks only for what is new)
    routed_experts_prompt_start: int = Field(0, ge=0)

    def extras(self) -> RowExtras:
        """This server's keys of ``extra_args`` (vLLM leaves the dict to plugins; other keys
        are ignored here as there)."""
        known = {k: v for k, v in (self.extra_args or {}).items() if k in RowExtras.model_fields}
        try:
            return RowExtras.model_validate(known)
        except ValueError as exc:
            raise ApiError(
                400, f"sampling_params.extra_args: {exc}", "sampling_params.extra_args"
            ) from exc


class RowExtras(BaseModel):
    """What a client of this project sends in ``sampling_params.extra_args``.

    Attributes:
        sample_seed: the row's ``GenerationDatumSpec.sample_seeds`` entry, used as it is
            (``seed`` is first spread over the request's ``n`` rows): a client that resolved
            its rows' seeds itself (``gen_interface.seeds.derive_sample_seeds``) gets exactly
            the tokens its own call would draw. Needs ``n`` = 1.
        max_weight_staleness: the row starts only on weights at most this many versions behind
            the newest announced (``GenerationConfig.max_weight_staleness``, per request).
    """

    sample_seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    max_weight_staleness: int | None = Field(None, ge=0)


class TokenizeRequest(_Strict):
    """``POST /tokenize``: a ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "give exactly one of `prompt` and `messages`")
        return self


class DetokenizeRequest(_Strict):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]
    #: This server's: leave special tokens out of the text (vLLM keeps them).
    skip_special_tokens: bool = False


def _check_stream(stream: bool, options: StreamOptions | None, prompt_logprobs: int | None) -> None:
    if options is not None and not stream:
        raise ApiError(
            400, "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    if stream and prompt_logprobs not in (None, 0):
        raise ApiError(
            400, "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
        )
