"""A server that shuts down drains: from the moment its shutdown begins (SIGTERM to
``gen-serve``, or the app's lifespan shutdown) a new request, or one held by ``/pause``, gets 503
with ``Retry-After`` at once, never a hang; ``/health`` says ``draining``; ``/metrics`` still
answers."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import pytest
import uvicorn
from fleet_backend import FleetNgram, client_of, ngram_app
from gen_serve.cli import _Server

COMPLETION = {"prompt": [5, 6, 7], "max_tokens": 4, "seed": 1}
#: A bound on waits that must end at once: reaching it means the request hung.
HANG_S = 30


@pytest.fixture
def backend() -> Any:
    backend = FleetNgram()
    yield backend
    backend.shutdown()


async def _until(condition: Any) -> None:
    async with asyncio.timeout(HANG_S):
        while not condition():
            await asyncio.sleep(0.01)


def test_a_draining_server_refuses_new_requests_at_once(backend: Any) -> None:
    app = ngram_app(backend)

    async def ask() -> tuple[Any, ...]:
        async with client_of(app) as client:
            before = await client.post("/v1/completions", json=COMPLETION)
            app.state.server.begin_draining()
            return (
                before,
                await client.post("/v1/completions", json=COMPLETION),
                await client.post(
                    "/inference/v1/generate", json={"token_ids": [5], "sampling_params": {}}
                ),
                await client.get("/v1/models"),
                await client.get("/health"),
                await client.get("/metrics"),
            )

    before, completion, generate, models, health, scrape = asyncio.run(ask())
    assert before.status_code == 200
    for refused in (completion, generate, models):
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "5"
        assert refused.headers["connection"] == "close"
        assert "shutting down" in refused.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert scrape.status_code == 200 and "gen:backend_fleet_replicas_serving" in scrape.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_shutdown_answers_requests_held_by_pause_with_503(backend: Any, stream: bool) -> None:
    app = ngram_app(backend)
    state = app.state.server

    async def shut_down_while_held() -> Any:
        async with client_of(app) as client:
            lifespan = app.router.lifespan_context(app)
            await lifespan.__aenter__()
            assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
            held = asyncio.ensure_future(
                client.post("/v1/completions", json={**COMPLETION, "stream": stream})
            )
            await _until(lambda: state.runner.in_flight == 1)
            assert not held.done()  # held at the door by /pause
            await lifespan.__aexit__(None, None, None)  # the shutdown begins
            async with asyncio.timeout(HANG_S):
                return await held

    answer = asyncio.run(shut_down_while_held())
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "5"
    assert "shutting down" in answer.json()["error"]["message"]
    assert backend.draining_at_shutdown is True  # drained before the backend stopped


def test_sigterm_starts_draining_before_uvicorn_waits_for_requests_in_flight(
    backend: Any,
) -> None:
    app = ngram_app(backend)
    server = _Server(uvicorn.Config(app))
    assert not app.state.server.draining
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and app.state.server.draining
