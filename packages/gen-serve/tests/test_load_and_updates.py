"""Many requests at once, a weight update in the middle of them, and clients that go away.

Bounded: 200 requests, each at most 48 tokens of a tiny model, on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
import tracemalloc
from typing import Any

import httpx
import pytest
from gen_interface.weights import handles_to_json, share_weights

SHORT, LONG = 2, 48


def _body(i: int, tokens: int) -> dict[str, Any]:
    return {
        "prompt": [5 + i % 50, 17, 42],
        "max_tokens": tokens,
        "temperature": 1.0,
        "seed": i,
        "ignore_eos": True,
        "return_token_ids": True,
        "return_weight_versions": True,
        "request_id": f"load-{i}",
    }


async def _update_weights_midway(server: Any, weights: dict[str, Any], after: float) -> int:
    """A keep-mode update through the HTTP routes, after ``after`` seconds: the new version."""
    await asyncio.sleep(after)
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        start = await http.post("/start_weight_update", json={"in_flight": "keep"})
        assert start.status_code == 200, start.text
        with share_weights(weights) as shared:
            load = await http.post(
                "/update_weights",
                json={"update_info": {"handles": handles_to_json(shared.handles)}},
            )
            assert load.status_code == 200, load.text
        version = server.state.backend.weight_version + 1
        finish = await http.post("/finish_weight_update", json={"weight_version": str(version)})
        assert finish.status_code == 200, finish.text
        return version


def test_200_requests_are_each_answered_once_short_first_with_an_update_midway(
    any_server, tiny_qwen2
):
    bodies = [_body(i, SHORT if i % 2 else LONG) for i in range(200)]
    finished: dict[int, float] = {}

    async def one(http: httpx.AsyncClient, i: int, started: float) -> dict[str, Any]:
        response = await http.post("/v1/completions", json=bodies[i])
        assert response.status_code == 200, response.text
        finished[i] = time.perf_counter() - started
        return response.json()

    async def run_all() -> tuple[list[dict[str, Any]], int]:
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(base_url=any_server.url, timeout=300, limits=limits) as http:
            started = time.perf_counter()
            update = asyncio.ensure_future(
                _update_weights_midway(any_server, tiny_qwen2.state_dict(), after=1.0)
            )
            replies = await asyncio.gather(*(one(http, i, started) for i in range(200)))
            return replies, await update

    gc.collect()
    tracemalloc.start()
    replies, version = asyncio.run(run_all())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    ids = [r["id"] for r in replies]
    assert len(set(ids)) == 200 and all(len(r["choices"]) == 1 for r in replies)
    for i, reply in enumerate(replies):
        choice = reply["choices"][0]
        assert len(choice["token_ids"]) == bodies[i]["max_tokens"]  # each its own answer
        versions = choice["weight_versions"]
        assert versions == sorted(versions) and set(versions) <= {version - 1, version}
    spans = [r["choices"][0]["weight_versions"] for r in replies]
    assert any(len(set(v)) == 2 for v in spans), "no row ran across the update"
    short = sorted(finished[i] for i in range(1, 200, 2))
    long = sorted(finished[i] for i in range(0, 200, 2))
    assert short[len(short) // 2] < long[len(long) // 2], "short requests waited for long ones"
    assert peak < 200 * 512 * 1024, f"the server held {peak / 2**20:.1f} MiB for 200 requests"


def test_a_client_that_goes_away_mid_stream_frees_its_rows(any_server):
    backend = any_server.state.backend
    body = {**_body(0, 400), "stream": True, "max_tokens": 400}

    async def leave_early() -> int:
        async with (
            httpx.AsyncClient(base_url=any_server.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            seen = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    seen += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                if seen >= 3:
                    break
            return seen

    assert asyncio.run(leave_early()) >= 3
    deadline = time.monotonic() + 20
    while any_server.state.runner.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any_server.state.runner.in_flight == 0, "the request still ran after its client left"
    rows = getattr(backend, "rows_in_flight", None)
    if rows is not None:  # the engines abort the row soon after (a message to each worker)
        while sum(rows()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(rows()) == 0, f"the engines still hold {rows()} rows"


def test_an_aborted_request_ends_at_once(any_server):
    async def abort_one() -> httpx.Response:
        async with httpx.AsyncClient(base_url=any_server.url, timeout=60) as http:
            pending = asyncio.ensure_future(
                http.post("/v1/completions", json={**_body(1, 400), "request_id": "abort-me"})
            )
            await asyncio.sleep(0.5)
            aborted = await http.post("/abort_requests", json={"request_ids": ["cmpl-abort-me"]})
            assert aborted.json() == {"status": "aborted", "aborted": 1}
            return await pending

    started = time.perf_counter()
    response = asyncio.run(abort_one())
    assert time.perf_counter() - started < 20
    assert response.status_code == 499, response.text


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_pause_holds_or_cuts_running_rows_and_resume_lets_them_go_on(any_server, mode):
    async def scenario() -> tuple[list[int], str | None, dict[str, Any]]:
        async with httpx.AsyncClient(base_url=any_server.url, timeout=120) as http:
            body = {**_body(2, 200), "stream": True}
            tokens: list[int] = []
            finish = None
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                async for line in reply.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    for choice in json.loads(line[6:])["choices"]:
                        tokens += choice.get("token_ids") or []
                        finish = choice.get("finish_reason") or finish
                    if len(tokens) and finish is None and not paused.is_set():
                        paused.set()  # the row runs: pause it now, while it has far to go
                        reply_pause = await http.post(f"/pause?mode={mode}")
                        assert reply_pause.json() == {"status": "paused"}
                        assert (await http.get("/is_paused")).json() == {"is_paused": True}
                        await asyncio.sleep(0.3)
                        assert (await http.post("/resume")).json() == {"status": "resumed"}
            again = (await http.post("/v1/completions", json={**_body(2, 4)})).json()
            return tokens, finish, again

    paused = threading.Event()
    tokens, finish, again = asyncio.run(scenario())
    assert paused.is_set(), "the row ended before its first token was streamed"
    if mode == "keep":
        assert finish == "length" and len(tokens) == 200
    else:
        assert finish == "abort" and 0 < len(tokens) < 200
    assert len(again["choices"][0]["token_ids"]) == 4  # serving again, weights unchanged


def test_metrics_publish_the_backend_s_own_counts(any_server):
    body = _body(0, 5)
    with httpx.Client(base_url=any_server.url, timeout=60) as http:
        assert http.post("/v1/completions", json=body).status_code == 200
        scraped = http.get("/metrics").text
    counted = any_server.state.backend.get_logger_metrics()
    lines = [line for line in scraped.splitlines() if line.startswith("gen:backend_rows_generated")]
    assert len(lines) == 1 and float(lines[0].rsplit(" ", 1)[1]) == counted["rows_generated_total"]
    assert counted["rows_generated_total"] >= 1
    assert "gen:backend_tokens_per_second" in scraped and "vllm:generation_tokens" in scraped
