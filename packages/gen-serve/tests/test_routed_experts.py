"""Routed experts over vLLM's token route: a choice's ``routed_experts`` is base64 of the
``.npy`` of ``[prompt + generated - 1, layers, top_k]`` (the last token was never read), as
vLLM sends it, from ``routed_experts_prompt_start`` on; ``None`` where the backend returns none."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gen_testkit.strategies import pad_prompts
from servers import ServerThread, hf_backend, serve

PROMPT = [5, 17, 42, 8, 99]


@pytest.fixture(scope="module")
def moe_server(tiny_qwen3_moe: Any) -> Iterator[ServerThread]:
    server = serve(hf_backend(tiny_qwen3_moe, return_routed_experts=True), tiny_qwen3_moe)
    yield server
    server.stop()


def _decoded(b64: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(b64)))


def _body(**sampling: Any) -> dict[str, Any]:
    return {
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 6, "temperature": 0, **sampling},
    }


def test_a_choice_carries_the_routing_the_backend_returns(moe_server: ServerThread):
    backend = moe_server.state.backend.with_sampling(max_new_tokens=6)
    want = backend.generate(pad_prompts([PROMPT], "right"), greedy=True)
    n = int(want["unpadded_sequence_lengths"][0])
    expected = want["routed_experts"][0, : n - 1].numpy()
    http = moe_server.client()
    choice = http.post("/inference/v1/generate", json=_body()).json()["choices"][0]
    assert choice["token_ids"] == want["output_ids"][0, len(PROMPT) : n].tolist()
    routed = _decoded(choice["routed_experts"])
    assert routed.dtype == np.uint8 and np.array_equal(routed, expected)

    later = http.post("/inference/v1/generate", json=_body(routed_experts_prompt_start=3))
    assert np.array_equal(_decoded(later.json()["choices"][0]["routed_experts"]), expected[3:])


def test_a_stream_sends_the_routing_with_its_last_chunk(moe_server: ServerThread):
    with moe_server.client().stream(
        "POST", "/inference/v1/generate", json={**_body(), "stream": True}
    ) as response:
        chunks = [
            json.loads(line.removeprefix("data: "))
            for line in response.iter_lines()
            if line.startswith("data: {")
        ]
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    assert all(c["routed_experts"] is None for c in choices[:-1])
    tokens = [t for c in choices for t in c["token_ids"] or []]
    routed = _decoded(choices[-1]["routed_experts"])
    assert routed.shape == (len(PROMPT) + len(tokens) - 1, 2, 2)


def test_none_where_the_backend_returns_no_routing(hf_server: ServerThread):
    answer = hf_server.client().post("/inference/v1/generate", json=_body()).json()
    choice = answer["choices"][0]
    assert choice["token_ids"] and choice["routed_experts"] is None
