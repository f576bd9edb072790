"""The healing checks against the testkit's n-gram fleet, and the fleet's own edges."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from gen_interface import NoReplicaServingError, RowLostError
from gen_testkit.conformance import ConformanceSubject, conformance_config
from gen_testkit.ngram.fleet import NgramFleet
from gen_testkit.strategies import pad_prompts
from gen_testkit.suite.healing import RESTARTS_NEEDED, HealingChecks

VOCAB = 512
PROMPTS = [[5 + i, 17, 42] for i in range(6)]


def ngram_fleet_subject(*, backend_cls=NgramFleet, replicas: int = 3):
    """A class's subject: a fleet of ``replicas`` n-gram replicas, a pause before each decode
    step so that a loss lands while rows run; shut down after the class."""
    config = conformance_config(
        backend="ngram",
        model_name="ngram",
        vocab_size=VOCAB,
        ngram={"seconds_per_step": 0.002},
    )
    backend = backend_cls(config, replicas=replicas, max_restarts=RESTARTS_NEEDED)
    yield ConformanceSubject(backend, VOCAB, backend._fleet.replicas[0].state_dict())
    backend.shutdown()


class TestNgramFleetHealing(HealingChecks):
    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls):
        yield from ngram_fleet_subject()

    @pytest.fixture(scope="class")
    @classmethod
    def replica_faults(cls, subject):
        return subject.backend


def _fleet(**kwargs) -> NgramFleet:
    config = conformance_config(
        backend="ngram", model_name="ngram", vocab_size=VOCAB, ngram={"seconds_per_step": 0.002}
    )
    return NgramFleet(config, **kwargs)


def _wait(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_past_its_restarts_the_fleet_runs_smaller_and_with_none_left_calls_fail_at_once():
    fleet = _fleet(replicas=2, max_restarts=0)
    try:
        batch = pad_prompts(PROMPTS, "left")
        expected = fleet.generate(batch, greedy=True)
        fleet.lose_replica(0)
        metrics = fleet.get_logger_metrics()
        assert metrics["fleet_replicas_serving"] == 1 and metrics["replica_0_state"] == 2
        assert fleet.generate(batch, greedy=True)["output_ids"].equal(expected["output_ids"])
        fleet.lose_replica(1)
        with pytest.raises(NoReplicaServingError, match="no replica of the fleet serves"):
            fleet.generate(batch, greedy=True)
    finally:
        fleet.shutdown()


def test_a_row_that_streamed_tokens_ends_the_call_with_a_typed_error_naming_it():
    fleet = _fleet(replicas=2)
    view = fleet.with_sampling(max_new_tokens=200, stop_token_ids=[])
    seen: dict[int, int] = {}

    async def stream() -> None:
        async for event in view.generate_stream(pad_prompts([[5, 6, 7], [9, 9]], "left")):
            seen[event.index] = seen.get(event.index, 0) + len(event.token_ids)
            if seen.get(0, 0) >= 2 and fleet.holds_rows(0):
                fleet.lose_replica(0)

    try:
        with pytest.raises(RowLostError, match=r"row\(s\) \[0\]") as caught:
            asyncio.run(stream())
        assert caught.value.rows == (0,) and caught.value.retryable
        _wait(lambda: fleet.get_logger_metrics()["fleet_replicas_serving"] == 2)
        assert view.with_sampling(max_new_tokens=4).generate(pad_prompts([[5]], "left")).size == 1
    finally:
        fleet.shutdown()


def test_a_replacement_waits_for_an_open_update_and_joins_at_its_version():
    fleet = _fleet(replicas=2)
    try:
        weights = fleet._fleet.replicas[0].state_dict()
        version = fleet.start_weight_update()
        fleet.lose_replica(1)
        time.sleep(0.1)
        assert fleet.get_logger_metrics()["replica_1_state"] == 4  # stale: not admitted yet
        fleet.update_weights_from_state_dict({k: v + 0.25 for k, v in weights.items()})
        assert fleet.commit_weight_update() == version
        _wait(lambda: fleet.get_logger_metrics()["fleet_replicas_serving"] == 2)
        metrics = fleet.get_logger_metrics()
        assert metrics["replica_0_weight_version"] == metrics["replica_1_weight_version"] == version
        out = fleet.generate(pad_prompts([[5, 17]] * 2, "left"), greedy=True)
        assert out["output_ids"][0].equal(out["output_ids"][1])
        assert set(out["weight_versions"][:, 2:].flatten().tolist()) == {version}
    finally:
        fleet.shutdown()


def test_a_loss_mid_call_re_runs_only_the_rows_that_had_not_finished():
    fleet = _fleet(replicas=2)
    try:
        view = fleet.with_sampling(max_new_tokens=40, stop_token_ids=[])
        batch = pad_prompts(PROMPTS, "left")
        expected = view.generate(batch)
        out: dict = {}
        thread = threading.Thread(target=lambda: out.setdefault("v", view.generate(batch)))
        thread.start()
        _wait(lambda: fleet.holds_rows(1))
        fleet.lose_replica(1)
        thread.join(30)
        assert out["v"]["output_ids"].equal(expected["output_ids"])
        assert out["v"]["logprobs"].equal(expected["logprobs"])
        assert fleet.get_logger_metrics()["fleet_rows_rerun_total"] == len(PROMPTS) // 2
    finally:
        fleet.shutdown()
