"""The metrics accumulator: percentiles, gauges across a clear, the staleness counters."""

from __future__ import annotations

import threading
import time

import pytest
from gen_backend_kit.metrics import GenerationMetrics
from gen_backend_kit.outputs import RowResult
from gen_interface import StaleWeightsError
from gen_testkit.conformance import conformance_config
from gen_testkit.ngram import NgramGeneration
from gen_testkit.strategies import pad_prompts


def _row(tokens: int, versions: list[int] | None = None) -> RowResult:
    return RowResult([1] * tokens, [0.0] * tokens, False, weight_versions=versions)


def test_p99_mean_and_gauges_that_survive_a_clear():
    metrics = GenerationMetrics()
    with metrics.call(100, lambda: 2) as count:
        for tokens in range(100):
            count.row(_row(tokens, [2] * (tokens // 2) + [0] * (tokens - tokens // 2)))
        with metrics.call(3, lambda: 2):  # a second call, once the 100 rows came back
            snapshot = metrics.snapshot()
            assert snapshot["rows_running"] == 3 and snapshot["rows_running_peak"] == 100
    snapshot = metrics.snapshot({"mine_total": 7})
    assert snapshot["rows_generated_total"] == 100 and snapshot["rows_running"] == 0
    assert snapshot["tokens_generated_total"] == sum(range(100))
    behind = snapshot["tokens_versions_behind_0_total"] + snapshot["tokens_versions_behind_2_total"]
    assert behind == sum(range(100)) and snapshot["mine_total"] == 7
    assert 0 < snapshot["row_seconds_mean"] <= snapshot["row_seconds_p99"]
    assert snapshot["time_to_first_token_seconds_p99"] == 0.0  # nothing streamed
    metrics.set_weight_version(4)
    metrics.clear()
    cleared = metrics.snapshot()
    assert cleared["rows_generated_total"] == 0 and cleared["weight_version"] == 4
    assert cleared["rows_running_peak"] == 0


def test_rows_refused_and_rows_held_by_the_staleness_bound_are_counted():
    config = conformance_config(backend="ngram", model_name="ngram", vocab_size=64)
    backend = NgramGeneration(dict(config, ngram={"vocab_size": 64, "order": 2}))
    try:
        batch = pad_prompts([[1, 2], [3]], "right")
        weights = backend.state_dict()
        strict = backend.with_sampling(max_weight_staleness=0)
        backend.announce_weight_version(1)
        with pytest.raises(StaleWeightsError):
            strict.generate(batch, greedy=True)
        assert backend.get_logger_metrics()["rows_refused_stale_total"] == 2
        backend.start_weight_update(1)
        waiting = threading.Thread(target=lambda: strict.generate(batch, greedy=True))
        waiting.start()
        time.sleep(0.3)  # the call waits for the update in progress
        backend.update_weights_from_state_dict(weights)
        backend.commit_weight_update()
        waiting.join(30)
        metrics = backend.get_logger_metrics()
        assert metrics["rows_waited_stale_total"] == 2 and metrics["rows_generated_total"] == 2
        assert metrics["refits_total"] == 1 and metrics["weight_version"] == 1
    finally:
        backend.shutdown()
