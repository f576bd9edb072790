"""A request's session (``session_id`` in the body, or the ``X-Session-ID`` header) reaches
every row of the backend's batch as ``session_ids``, where gen-vllm's router keeps the
conversation on one replica (``packages/gen-vllm/tests/test_driver_loop_and_router.py``)."""

from __future__ import annotations

from typing import Any

import pytest


def test_a_requests_session_reaches_every_row_of_its_batch(
    hf_server: Any, monkeypatch: pytest.MonkeyPatch
):
    backend = hf_server.state.backend
    seen: list[Any] = []
    original = backend.generate_stream

    def recording(batch: Any, greedy: bool = False) -> Any:
        seen.append(batch.get("session_ids"))
        return original(batch, greedy)

    monkeypatch.setattr(backend, "generate_stream", recording)
    http = hf_server.client()
    body = {"token_ids": [5, 17], "sampling_params": {"max_tokens": 2, "temperature": 0}}
    answers = [
        http.post("/inference/v1/generate", json={**body, "session_id": "conv-1"}),
        http.post("/inference/v1/generate", json=body, headers={"X-Session-ID": "conv-2"}),
        http.post(
            "/v1/completions",
            json={"prompt": [5, 17], "max_tokens": 2, "n": 2, "session_id": "conv-3"},
        ),
        http.post("/inference/v1/generate", json=body),
        http.post("/inference/v1/generate", json={**body, "session_id": ""}),
    ]
    assert [a.status_code for a in answers] == [200, 200, 200, 200, 400]
    assert seen == [["conv-1"], ["conv-2"], ["conv-3", "conv-3"], None]
