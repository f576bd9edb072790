"""The official ``openai`` client against gen-serve, on both backends: completions, chat,
streaming, ``n`` > 1, token-id prompts, top-k logprobs, and a multi-turn conversation whose ids
and logprobs equal one ``score`` of the whole trajectory."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import torch
from gen_interface import BatchedDataDict
from gen_testkit.tolerances import tolerance_for

TOKENS = [5, 17, 42, 8, 99, 3]


def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_completion_of_token_ids_reports_ids_and_logprobs(any_server):
    out = client(any_server).completions.create(
        model="tiny",
        prompt=TOKENS,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"return_token_ids": True, "top_k": -1},
    )
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    assert len(ids) == 6 and out.usage.completion_tokens == 6 and out.usage.prompt_tokens == 6
    assert choice.model_extra["prompt_token_ids"] == TOKENS
    assert choice.finish_reason in ("stop", "length")
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4  # the chosen token first, then the top 3
        assert max(top.values()) == pytest.approx(logprob, abs=1e-6)  # greedy: the top one


def test_completion_of_text_and_of_several_prompts(any_server):
    out = client(any_server).completions.create(
        model="tiny", prompt=["The quick brown", "Pack my box"], max_tokens=4, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert all(isinstance(c.text, str) for c in out.choices)


def test_n_samples_per_prompt_are_distinct_and_indexed_like_vllm(any_server):
    out = client(any_server).completions.create(
        model="tiny",
        prompt=[TOKENS, TOKENS[:3]],
        n=3,
        max_tokens=8,
        temperature=1.0,
        seed=7,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in out.choices] == list(range(6))
    first = [tuple(c.model_extra["token_ids"]) for c in out.choices[:3]]
    assert len(set(first)) > 1, "three samples of one prompt were identical"
    again = client(any_server).completions.create(
        model="tiny",
        prompt=[TOKENS, TOKENS[:3]],
        n=3,
        max_tokens=8,
        temperature=1.0,
        seed=7,
        extra_body={"return_token_ids": True},
    )
    assert [c.model_extra["token_ids"] for c in again.choices] == [
        c.model_extra["token_ids"] for c in out.choices
    ]


def test_chat_with_top_logprobs_and_tools_in_the_template(any_server):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    out = client(any_server).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Pack my box"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        tools=tools,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"])
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
    rendered = any_server.state.codec.decode(
        out.model_extra["prompt_token_ids"], skip_special_tokens=False
    )
    assert '"lookup"' in rendered, "the tool definitions did not reach the chat template"


def test_streamed_completion_equals_the_whole_one(any_server):
    api = client(any_server)
    kwargs = dict(model="tiny", prompt=TOKENS, max_tokens=10, temperature=0)
    whole = api.completions.create(**kwargs, extra_body={"return_token_ids": True})
    chunks = list(
        api.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])]
    assert ids == whole.choices[0].model_extra["token_ids"]
    assert "".join(ch.text for c in chunks for ch in c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == len(ids)
    assert [ch.finish_reason for c in chunks for ch in c.choices][-1] == whole.choices[
        0
    ].finish_reason


def test_streamed_chat_ends_with_the_finish_reason(any_server):
    chunks = list(
        client(any_server).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_three_turn_conversation_equals_one_score_of_the_trajectory(any_server):
    """Each turn sends the ids the server returned, as given, plus the next user turn; the
    trajectory's ids and reported logprobs are what one teacher-forced score gives."""
    api = client(any_server)
    codec = any_server.state.codec
    ids = codec.encode("<s>user\nThe quick brown fox</s>\n<s>assistant\n", add_special_tokens=False)
    spans = []
    reported: list[float] = []
    for turn in range(3):
        out = api.completions.create(
            model="tiny",
            prompt=ids,
            max_tokens=6,
            temperature=1.0,
            seed=turn,
            logprobs=0,
            extra_body={"return_token_ids": True},
        )
        choice = out.choices[0]
        assert choice.model_extra["prompt_token_ids"] == ids  # used as given, not re-rendered
        new = choice.model_extra["token_ids"]
        spans.append((len(ids), len(new)))
        reported += choice.logprobs.token_logprobs
        user = codec.encode(
            f"</s>\n<s>user\nturn {turn}</s>\n<s>assistant\n", add_special_tokens=False
        )
        ids = ids + new + (user if turn < 2 else [])
    backend = any_server.state.backend
    scored = backend.score(
        BatchedDataDict(
            input_ids=torch.tensor([ids]),
            prompt_lengths=torch.tensor([1]),
            unpadded_sequence_lengths=torch.tensor([len(ids)]),
        )
    )[0]
    expected = torch.cat([scored[start : start + n] for start, n in spans])
    tolerance = tolerance_for("float32", across_backends=False)
    assert torch.allclose(torch.tensor(reported), expected, atol=tolerance.logprob_atol), (
        f"largest difference {float((torch.tensor(reported) - expected).abs().max()):.3g}"
    )


def test_models_and_errors_reach_the_client_typed(any_server):
    api = client(any_server)
    assert [m.id for m in api.models.list().data] == ["tiny"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.completions.create(model="tiny", prompt=TOKENS, max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="another", prompt=TOKENS, max_tokens=2)
