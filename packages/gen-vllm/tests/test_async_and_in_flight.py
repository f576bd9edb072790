"""Rows streamed by generate_async, weight updates while rows run and the staleness bound, on a
real vLLM engine (the testkit's checks), and rows of a closed stream leaving the engines."""

import asyncio
import contextlib
import time

import pytest
from gen_testkit.strategies import pad_prompts
from gen_testkit.suite.async_rows import AsyncRowChecks
from gen_testkit.suite.base import ConformanceSubject
from gen_testkit.suite.in_flight import InFlightUpdateChecks
from gen_testkit.suite.staleness import StalenessChecks


class TestInFlightUpdates(InFlightUpdateChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, engines, tiny_qwen2):
        backend = engines.get(tiny_qwen2, replicas=1)
        return ConformanceSubject.for_model(backend, tiny_qwen2)


class TestAsyncRows(AsyncRowChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, engines, tiny_qwen2):
        backend = engines.get(tiny_qwen2, replicas=2)
        return ConformanceSubject.for_model(backend, tiny_qwen2)


class TestStaleness(StalenessChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls, engines, tiny_qwen2):
        backend = engines.get(tiny_qwen2, replicas=1)
        return ConformanceSubject.for_model(backend, tiny_qwen2)


#: Rows of a closed stream leave their engines within this; running on, they would need far longer.
LEAVE_WITHIN_S = 5.0


def test_closing_a_stream_aborts_its_rows_in_the_engines(engines, tiny_qwen2):
    """Rows of a closed ``generate_async`` leave the engines at once, long before they could
    have finished; the backend then serves the next call."""
    backend = engines.get(tiny_qwen2, replicas=2)
    long = backend.context_limit - 8
    view = backend.with_sampling(max_new_tokens=long, stop_token_ids=[])
    batch = pad_prompts([[5, 17], [99, 3], [7, 7, 7], [11, 12]], "left")

    async def start_then_close() -> list[int]:
        stream = view.generate_async(batch, greedy=True)
        first = asyncio.ensure_future(stream.__anext__())
        deadline = time.monotonic() + 60
        while sum(await asyncio.to_thread(backend.rows_in_flight)) < batch.size:
            assert time.monotonic() < deadline, "the rows never reached the engines"
            assert not first.done(), f"a row of {long} tokens finished first"
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await stream.aclose()
        closed = time.monotonic()
        while (held := await asyncio.to_thread(backend.rows_in_flight)) != [0, 0]:
            if time.monotonic() - closed > LEAVE_WITHIN_S:
                return held
            await asyncio.sleep(0.05)
        return held

    assert asyncio.run(start_then_close()) == [0, 0]
    out = view.with_sampling(max_new_tokens=3).generate(batch, greedy=True)
    assert out["generation_lengths"].tolist() == [3] * batch.size
