"""Logger metrics: after a known workload, every counter says what ran."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch
from gen_interface import StaleWeightsError
from gen_interface.weights import refit

from gen_testkit.suite.base import ConformanceSubject, SuiteBase

__all__ = ["MetricsProperties"]

#: A backend's per-replica count of generated tokens (other per-replica metrics may sit beside it).
_REPLICA_TOKENS = re.compile(r"replica_\d+_tokens_generated_total")


class MetricsProperties(SuiteBase):
    """``get_logger_metrics`` / ``clear_logger_metrics`` count exactly what the backend did."""

    def test_metrics_count_the_rows_and_tokens_of_a_known_workload(
        self, subject: ConformanceSubject
    ):
        backend, batch = subject.backend, self._fixed_batch(subject)
        backend.clear_logger_metrics()
        first = backend.generate(batch, greedy=True)

        async def rows_one_by_one() -> int:
            return sum([1 async for _ in backend.generate_async(batch, greedy=True)])

        assert asyncio.run(rows_one_by_one()) == batch.size
        metrics = backend.get_logger_metrics()
        tokens = 2 * int(first["generation_lengths"].sum())
        assert metrics["generate_calls_total"] == 2
        assert metrics["rows_generated_total"] == 2 * batch.size
        assert metrics["tokens_generated_total"] == tokens
        assert metrics["rows_truncated_total"] == 2 * int(first["truncated"].sum())
        assert metrics["rows_cut_short_total"] == 0
        assert metrics["rows_running"] == 0
        assert 1 <= metrics["rows_running_peak"] <= batch.size
        assert metrics["row_seconds_mean"] > 0 and metrics["row_seconds_p99"] > 0
        assert metrics["tokens_per_second"] > 0
        behind = sum(v for k, v in metrics.items() if k.startswith("tokens_versions_behind_"))
        assert behind == tokens == metrics.get("tokens_versions_behind_0_total", 0)
        per_replica = [v for k, v in metrics.items() if _REPLICA_TOKENS.fullmatch(k)]
        assert not per_replica or sum(per_replica) == tokens
        assert all(isinstance(v, int | float) for v in metrics.values())
        backend.clear_logger_metrics()
        cleared = backend.get_logger_metrics()
        assert cleared["rows_generated_total"] == cleared["tokens_generated_total"] == 0
        counters = [k for k in cleared if k.startswith("replica_") and k.endswith("_total")]
        assert all(cleared[k] == 0 for k in counters), {k: cleared[k] for k in counters}

    def test_metrics_count_refits_versions_and_stale_refusals(self, subject: ConformanceSubject):
        if not self.claims_weight_updates:
            pytest.skip("backend does not claim weight updates")
        assert subject.state_dict is not None
        backend, batch = subject.backend, self._fixed_batch(subject)
        weights = {k: v.detach().clone() for k, v in subject.state_dict.items()}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        backend.clear_logger_metrics()
        version = refit(backend, weights)
        metrics = backend.get_logger_metrics()
        assert metrics["refits_total"] == 1 and metrics["weight_version"] == version
        assert metrics["refit_bytes_total"] == nbytes
        assert metrics["refit_sent_bytes_total"] == nbytes  # whole: every byte crossed
        assert metrics["refit_delta_tensors_total"] == 0 and metrics["refit_delta_ratio"] == 1.0
        assert metrics["refit_tensors_total"] in (0, len(weights))  # 0: the backend counts none
        phases = [metrics[f"refit_{p}_seconds_total"] for p in ("begin", "load", "commit")]
        assert all(p > 0 for p in phases) and sum(phases) <= metrics["refit_seconds_max"]
        backend.announce_weight_version(version + 3)
        strict = backend.with_sampling(max_weight_staleness=1)
        with pytest.raises(StaleWeightsError):
            strict.generate(batch, greedy=True)
        assert backend.get_logger_metrics()["rows_refused_stale_total"] == batch.size
        out = backend.generate(batch, greedy=True)  # no bound: runs, 3 versions behind
        behind = backend.get_logger_metrics().get("tokens_versions_behind_3_total", 0)
        assert behind == int(out["generation_lengths"].sum())
        refit(backend, weights, version=version + 3)  # back in step for the next test
        assert torch.equal(backend.generate(batch, greedy=True)["output_ids"], out["output_ids"])
