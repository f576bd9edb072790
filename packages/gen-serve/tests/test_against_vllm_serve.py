"""The same requests to vLLM's own server and to gen-serve (over each backend) on the same tiny
model: the same JSON keys and value types, greedy token ids identical (a split only at a
near-tie of vLLM's own top two), and logprobs within the cross-backend tolerance; for
completions, chat, ``/inference/v1/generate``, tokenize and detokenize, streamed and not.

vLLM's server runs in a process of its own (``python -m vllm.entrypoints.openai.api_server``;
its ``vllm`` command cannot start from the CPU build), with the RL routes and the
token-in-token-out route mounted, on 127.0.0.1.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from gen_testkit.servers import ServerProcess
from gen_testkit.tolerances import tolerance_for

#: Keys this server adds to vLLM's objects (each choice's weight version).
OURS_ONLY = frozenset({"weight_version", "weight_versions"})

#: Objects keyed by data (a token's text or id), not by field name: their keys are compared as
#: values are (greedy tokens split at near-ties), only their values' kinds here.
KEYED_BY_TOKEN = ("top_logprobs[0]", "prompt_logprobs[1]")

TOLERANCE = tolerance_for("float32", across_backends=True)

IDS = [5, 17, 42, 8, 99, 3]


def _both(vllm_serve: ServerProcess, ours: Any, path: str, body: Any) -> tuple[Any, Any]:
    replies = [httpx.post(f"{s.url}{path}", json=body, timeout=120) for s in (vllm_serve, ours)]
    for server, reply in zip(("vllm serve", "gen-serve"), replies):
        assert reply.status_code == 200, f"{server} {path}: {reply.text}"
    return replies[0].json(), replies[1].json()


def _stream(server: Any, path: str, body: Any) -> list[Any]:
    chunks = []
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-1]
    for line in lines[:-1]:
        assert line.startswith("data: "), line
        chunks.append(json.loads(line[6:]))
    return chunks


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def assert_same_shape(theirs: Any, ours: Any, path: str = "$") -> None:
    """Every object has vLLM's keys (and only ``OURS_ONLY`` beside them), every value vLLM's
    JSON type, all the way down (lists compared by their first items)."""
    if isinstance(theirs, dict) and path.endswith(KEYED_BY_TOKEN):
        assert isinstance(ours, dict), f"{path}: {_kind(ours)}, vLLM gives an object"
        if theirs and ours:
            assert_same_shape(next(iter(theirs.values())), next(iter(ours.values())), path)
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict), f"{path}: {_kind(ours)}, vLLM gives an object"
        missing = sorted(theirs.keys() - ours.keys())
        extra = sorted(ours.keys() - theirs.keys() - OURS_ONLY)
        assert not missing and not extra, f"{path}: missing {missing}, extra {extra}"
        for key in theirs:
            assert_same_shape(theirs[key], ours[key], f"{path}.{key}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list), f"{path}: {_kind(ours)}, vLLM gives a list"
        if theirs and ours:
            assert_same_shape(theirs[0], ours[0], f"{path}[0]")
    else:
        assert _kind(theirs) == _kind(ours), f"{path}: {ours!r}, vLLM gives {theirs!r}"


def assert_same_tokens(
    theirs: list[int], ours: list[int], their_top: list[list[float]], what: str
) -> int:
    """Greedy ids equal, or equal up to a split where vLLM's top two are within the near-tie
    margin; returns how many leading tokens are comparable."""
    same = next((j for j, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
    if same is None:
        assert len(theirs) == len(ours), f"{what}: {theirs} vs {ours}"
        return len(theirs)
    top = sorted(their_top[same], reverse=True)
    assert len(top) >= 2 and top[0] - top[1] <= TOLERANCE.near_tie, (
        f"{what}: token {same} is {ours[same]} here, {theirs[same]} in vLLM, whose top two are "
        f"{top[:2]} apart by more than the near-tie margin"
    )
    return same


def assert_same_rank(theirs: int, ours: int | None, k: int) -> None:
    """The same rank; or, for a token outside the top ``k`` asked for, None here (backends
    report no rank beyond their top-k lists; vLLM ranks it in the whole vocabulary)."""
    if ours is None:
        assert theirs > k, f"no rank here, {theirs} in vLLM, within the top {k}"
    else:
        assert ours == theirs


def assert_close(theirs: list[float], ours: list[float], what: str) -> None:
    worst = max((abs(a - b) for a, b in zip(theirs, ours)), default=0.0)
    assert worst <= TOLERANCE.logprob_atol, f"{what}: logprobs differ by {worst:.3g}"


# ---- completions ---------------------------------------------------------------------------


def test_completions_of_ids_with_top_logprobs(vllm_serve, any_server):
    body = {
        "model": "tiny",
        "prompt": IDS,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 2,
        "return_token_ids": True,
    }
    theirs, ours = _both(vllm_serve, any_server, "/v1/completions", body)
    assert_same_shape(theirs, ours)
    a, b = theirs["choices"][0], ours["choices"][0]
    assert b["prompt_token_ids"] == a["prompt_token_ids"] == IDS
    tops = [list(t.values()) for t in a["logprobs"]["top_logprobs"]]
    n = assert_same_tokens(a["token_ids"], b["token_ids"], tops, "completions")
    assert_close(a["logprobs"]["token_logprobs"][:n], b["logprobs"]["token_logprobs"][:n], "tokens")
    for j in range(n):
        top_a, top_b = a["logprobs"]["top_logprobs"][j], b["logprobs"]["top_logprobs"][j]
        assert top_a.keys() == top_b.keys(), f"position {j}: {top_a} vs {top_b}"
        assert_close([top_a[k] for k in top_a], [top_b[k] for k in top_a], f"top-2 at {j}")
    assert b["text"] == a["text"][: len(b["text"])] or n < 8


def test_completions_of_text_with_prompt_logprobs_and_ids_as_tokens(vllm_serve, any_server):
    body = {
        "model": "tiny",
        "prompt": "hello world",
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 1,
        "prompt_logprobs": 1,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }
    theirs, ours = _both(vllm_serve, any_server, "/v1/completions", body)
    assert_same_shape(theirs, ours)
    a, b = theirs["choices"][0], ours["choices"][0]
    assert a["prompt_token_ids"] == b["prompt_token_ids"], "the prompt was tokenized differently"
    assert all(t.startswith("token_id:") for t in b["logprobs"]["tokens"])
    tops = [list(t.values()) for t in a["logprobs"]["top_logprobs"]]
    n = assert_same_tokens(a["token_ids"], b["token_ids"], tops, "text completion")
    assert a["logprobs"]["tokens"][:n] == b["logprobs"]["tokens"][:n]
    assert_close(a["logprobs"]["token_logprobs"][:n], b["logprobs"]["token_logprobs"][:n], "tokens")
    prompt_a, prompt_b = a["prompt_logprobs"], b["prompt_logprobs"]
    assert prompt_a[0] is None and prompt_b[0] is None and len(prompt_a) == len(prompt_b)
    for j in range(1, len(prompt_a)):
        assert prompt_a[j].keys() == prompt_b[j].keys(), f"prompt position {j}"
        for token in prompt_a[j]:
            assert_close([prompt_a[j][token]["logprob"]], [prompt_b[j][token]["logprob"]], token)
            assert_same_rank(prompt_a[j][token]["rank"], prompt_b[j][token]["rank"], k=1)


# ---- chat ----------------------------------------------------------------------------------


def test_chat_with_top_logprobs(vllm_serve, any_server):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
    }
    theirs, ours = _both(vllm_serve, any_server, "/v1/chat/completions", body)
    assert_same_shape(theirs, ours)
    assert theirs["prompt_token_ids"] == ours["prompt_token_ids"], "the template rendered apart"
    a, b = theirs["choices"][0], ours["choices"][0]
    content_a, content_b = a["logprobs"]["content"], b["logprobs"]["content"]
    tops = [[t["logprob"] for t in c["top_logprobs"]] for c in content_a]
    n = assert_same_tokens(a["token_ids"], b["token_ids"], tops, "chat")
    assert_close(
        [c["logprob"] for c in content_a[:n]], [c["logprob"] for c in content_b[:n]], "chat"
    )
    for j in range(n):
        assert [t["token"] for t in content_a[j]["top_logprobs"]] == [
            t["token"] for t in content_b[j]["top_logprobs"]
        ]


# ---- token in, token out -------------------------------------------------------------------


def test_inference_generate(vllm_serve, any_server):
    body = {
        "model": "tiny",
        "token_ids": IDS,
        "sampling_params": {"max_tokens": 8, "temperature": 0, "logprobs": 2},
    }
    theirs, ours = _both(vllm_serve, any_server, "/inference/v1/generate", body)
    assert_same_shape(theirs, ours)
    a, b = theirs["choices"][0], ours["choices"][0]
    content_a, content_b = a["logprobs"]["content"], b["logprobs"]["content"]
    tops = [[t["logprob"] for t in c["top_logprobs"]] for c in content_a]
    n = assert_same_tokens(a["token_ids"], b["token_ids"], tops, "generate")
    assert_close(
        [c["logprob"] for c in content_a[:n]], [c["logprob"] for c in content_b[:n]], "ids"
    )
    for c_a, c_b in zip(content_a[:n], content_b[:n]):
        assert_same_rank(c_a["rank"], c_b["rank"], k=2)


# ---- tokenizer routes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"model": "tiny", "prompt": "hello world, again"}),
        ("/tokenize", {"model": "tiny", "prompt": "hello", "return_token_strs": True}),
        ("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
        ("/detokenize", {"model": "tiny", "tokens": [70, 71, 72, 5]}),
    ],
)
def test_tokenizer_routes(vllm_serve, any_server, path, body):
    theirs, ours = _both(vllm_serve, any_server, path, body)
    assert_same_shape(theirs, ours)
    assert theirs == ours


# ---- streaming -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/completions",
            {
                "prompt": IDS,
                "max_tokens": 6,
                "logprobs": 1,
                "return_token_ids": True,
                "stream_options": {"include_usage": True},
            },
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 6,
                "logprobs": True,
                "top_logprobs": 1,
                "return_token_ids": True,
                "stream_options": {"include_usage": True},
            },
        ),
        (
            "/inference/v1/generate",
            {"token_ids": IDS, "sampling_params": {"max_tokens": 6, "temperature": 0}},
        ),
    ],
    ids=["completions", "chat", "generate"],
)
def test_streams(vllm_serve, any_server, path, body):
    body = {"model": "tiny", "temperature": 0, **body, "stream": True}
    if path == "/inference/v1/generate":
        body.pop("temperature")
    theirs, ours = _stream(vllm_serve, path, body), _stream(any_server, path, body)
    # Every chunk has the keys and types of vLLM's chunk of its kind (first, token, last, usage).
    kinds_a = {_chunk_kind(c): c for c in theirs}
    kinds_b = {_chunk_kind(c): c for c in ours}
    # A stream's middle may be one chunk or many (what a slow reader has not taken yet is sent
    # at once, by both servers), so only the kinds at its ends must be there in both.
    ends = {"first", "last", "usage"} & kinds_a.keys()
    assert ends <= kinds_b.keys(), (sorted(kinds_a), sorted(kinds_b))
    for kind in kinds_a.keys() & kinds_b.keys():
        assert_same_shape(kinds_a[kind], kinds_b[kind], f"$<{kind} chunk>")
    ids_a, ids_b = _streamed_ids(theirs), _streamed_ids(ours)
    assert ids_a == ids_b, f"streamed {ids_b}, vLLM {ids_a}"
    # The finish comes with the last token (or the last few: both servers send what a slow
    # reader has not taken yet in one chunk), not in a chunk of its own.
    last_a, last_b = (kinds["last"]["choices"][0]["token_ids"] for kinds in (kinds_a, kinds_b))
    assert last_a and last_b and last_a[-1] == last_b[-1] == ids_a[-1], (last_a, last_b)


def _streamed_ids(chunks: list[dict[str, Any]]) -> list[int]:
    return [
        t for c in chunks for choice in c.get("choices", []) for t in choice.get("token_ids") or []
    ]


def _chunk_kind(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return "usage"
    choice = choices[0]
    if choice.get("finish_reason") is not None:
        return "last"
    if "role" in (choice.get("delta") or {}) or choice.get("prompt_token_ids") is not None:
        return "first"
    return "token"
