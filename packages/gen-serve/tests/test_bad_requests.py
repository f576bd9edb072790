"""Every malformed request gets a 4xx in OpenAI's error shape naming what is wrong, the server
keeps serving, and no later output changes."""

from __future__ import annotations

import json

import pytest
from servers import hf_backend, serve

GOOD = {"prompt": [5, 17, 42, 8], "max_tokens": 6, "temperature": 0, "logprobs": 1}

#: (what is wrong, path, body or raw bytes, status, words the message must hold)
BAD = [
    ("malformed JSON", "/v1/completions", b'{"prompt": [5, 6', 400, "not valid JSON"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, "JSON object"),
    (
        "unknown field",
        "/v1/completions",
        {**GOOD, "max_tokenz": 3},
        400,
        "did you mean `max_tokens`",
    ),
    ("negative max_tokens", "/v1/completions", {**GOOD, "max_tokens": -5}, 400, "max_tokens"),
    ("huge max_tokens", "/v1/completions", {**GOOD, "max_tokens": 10**9}, 400, "max_model_len"),
    (
        "id outside the vocabulary",
        "/v1/completions",
        {**GOOD, "prompt": [5, 600]},
        400,
        "vocabulary",
    ),
    (
        "negative id",
        "/inference/v1/generate",
        {"token_ids": [5, -1], "sampling_params": {}},
        400,
        "token_ids",
    ),
    ("wrong type", "/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    (
        "temperature out of range",
        "/v1/completions",
        {**GOOD, "temperature": 3.0},
        400,
        "temperature",
    ),
    ("greedy with n > 1", "/v1/completions", {**GOOD, "n": 2}, 400, "n must be 1"),
    ("a live vLLM field", "/v1/completions", {**GOOD, "presence_penalty": 0.5}, 400, "penalties"),
    ("empty prompt", "/v1/completions", {**GOOD, "prompt": []}, 400, "prompt"),
    (
        "prompt filling the context",
        "/v1/completions",
        {**GOOD, "prompt": [5] * 512},
        400,
        "context",
    ),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "image content",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "text only",
    ),
    (
        "unknown sampling param",
        "/inference/v1/generate",
        {"token_ids": [5], "sampling_params": {"temprature": 1}},
        400,
        "did you mean `temperature`",
    ),
    ("too many top logprobs", "/v1/completions", {**GOOD, "logprobs": 500}, 400, "top_logprobs"),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-9"}, 404, "does not exist"),
    (
        "prompt_logprobs with stream",
        "/v1/completions",
        {**GOOD, "stream": True, "prompt_logprobs": 1},
        400,
        "stream",
    ),
]


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    made = serve(hf_backend(tiny_qwen2), tiny_qwen2, max_body_bytes=64 * 1024, api_key="secret")
    yield made
    made.stop()


def _post(http, path, body):
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


def test_every_bad_request_is_a_4xx_with_a_message_and_changes_nothing(server):
    http = server.client(headers={"authorization": "Bearer secret"})
    before = http.post("/v1/completions", json=GOOD).json()["choices"][0]
    for what, path, body, status, words in BAD:
        response = _post(http, path, body)
        assert response.status_code == status, f"{what}: {response.status_code} {response.text}"
        error = response.json()["error"]
        # OpenAI's four fields; a backend's error also names its gen_interface class
        assert set(error) - {"gen_error"} == {"message", "type", "param", "code"}, what
        assert error["code"] == status
        assert error.get("gen_error", "GenerationInputError") == "GenerationInputError", what
        assert words in error["message"], f"{what}: {error['message']!r} lacks {words!r}"
        assert http.get("/health").status_code == 200, f"{what} broke the server"
    after = http.post("/v1/completions", json=GOOD).json()["choices"][0]
    assert after["text"] == before["text"] and after["logprobs"] == before["logprobs"]


def test_an_oversized_body_is_413_and_a_wrong_key_401(server):
    http = server.client(headers={"authorization": "Bearer secret"})
    big = json.dumps({**GOOD, "prompt": [5] * 40_000}).encode()
    assert _post(http, "/v1/completions", big).status_code == 413
    wrong = server.client(headers={"authorization": "Bearer nope"})
    response = wrong.post("/v1/completions", json=GOOD)
    assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
    assert server.client().get("/health").status_code == 200  # /health needs no key
    assert server.client().get("/v1/models").status_code == 401
    assert http.post("/v1/completions", json=GOOD).status_code == 200
