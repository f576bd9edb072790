"""A fleet's retryable errors are retryable answers: ``NoReplicaServingError`` and
``RowLostError`` are 503 with ``Retry-After`` and an OpenAI error naming them (``gen_error``,
and for a lost row its ``rows``); in a stream that already answered 200, an SSE error event with
the same body, then ``[DONE]``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fleet_backend import FleetNgram, client_of, ngram_app
from gen_interface import NoReplicaServingError

PROMPT = [5, 6, 7]
ROUTES = {
    "completions": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 6, "seed": 1, "ignore_eos": True},
    ),
    "generate": (
        "/inference/v1/generate",
        {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "seed": 1, "ignore_eos": True}},
    ),
}


def post(backend: Any, route: str, **extra: Any) -> Any:
    path, body = ROUTES[route]

    async def ask() -> Any:
        async with client_of(ngram_app(backend)) as client:
            return await client.post(path, json={**body, **extra})

    return asyncio.run(ask())


def sse_payloads(text: str) -> list[Any]:
    """Each ``data:`` event of a stream, parsed (``[DONE]`` as the string)."""
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    return [event if event == "[DONE]" else json.loads(event) for event in events]


@pytest.fixture
def backend() -> Any:
    backend = FleetNgram(replicas=2)
    yield backend
    backend.shutdown()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_no_replica_serving_is_503_with_retry_after(backend: Any, route: str, stream: bool) -> None:
    backend.refuse = NoReplicaServingError(
        "no replica serves now: 2 dead, 0 restarting; retry once a replacement is admitted"
    )
    answer = post(backend, route, stream=stream)
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "5"
    error = answer.json()["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert error["gen_error"] == "NoReplicaServingError"
    assert "no replica serves now" in error["message"]


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_row_lost_before_the_answer_is_503_naming_the_row(backend: Any, route: str) -> None:
    backend.lose_row_after = 2
    answer = post(backend, route)
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "1"
    error = answer.json()["error"]
    assert (error["gen_error"], error["rows"], error["code"]) == ("RowLostError", [0], 503)
    assert "run it again" in error["message"]


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_row_lost_mid_stream_ends_the_stream_with_an_error_event(
    backend: Any, route: str
) -> None:
    backend.lose_row_after = 2
    answer = post(backend, route, stream=True)
    assert answer.status_code == 200  # the headers went out with the first tokens
    events = sse_payloads(answer.text)
    assert events[-1] == "[DONE]"
    *chunks, error_event = events[:-1]
    assert chunks and all("error" not in chunk for chunk in chunks)  # tokens came first
    error = error_event["error"]
    assert (error["code"], error["type"]) == (503, "ServiceUnavailableError")
    assert (error["gen_error"], error["rows"]) == ("RowLostError", [0])
