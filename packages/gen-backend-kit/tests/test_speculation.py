"""``gen_backend_kit.speculation``: unoffered methods refused by name, the counts, and the one
warning when acceptance falls below the floor where speculation stops paying."""

from __future__ import annotations

import logging

import pytest
from gen_backend_kit.speculation import (
    SPECULATION_METRICS,
    WINDOW_PROPOSED,
    SpeculationCounts,
    refuse_unoffered_speculation,
)
from gen_interface import GenerationConfigError


def test_a_method_the_backend_does_not_offer_is_refused_by_name():
    refuse_unoffered_speculation({"speculative": None}, "B", frozenset())
    refuse_unoffered_speculation({"speculative": {"method": "ngram"}}, "B", frozenset({"ngram"}))
    with pytest.raises(GenerationConfigError, match=r"'eagle' is set but B does not offer it"):
        refuse_unoffered_speculation(
            {"speculative": {"method": "eagle"}}, "B", frozenset({"ngram"})
        )
    with pytest.raises(GenerationConfigError, match="offers no speculative decoding"):
        refuse_unoffered_speculation({"speculative": {"method": "ngram"}}, "B", frozenset())


def test_counts_add_up_and_refuse_more_accepted_than_proposed():
    counts = SpeculationCounts()
    counts.add(drafts=4, proposed=12, accepted=6)
    counts.add(drafts=2, proposed=6, accepted=0)
    metrics = counts.metrics()
    assert set(metrics) == set(SPECULATION_METRICS)
    assert metrics["speculative_drafts_total"] == 6
    assert metrics["speculative_acceptance_rate"] == pytest.approx(6 / 18)
    assert metrics["speculative_mean_accepted_length"] == pytest.approx(1 + 6 / 6)
    with pytest.raises(ValueError, match="accepted <= proposed"):
        counts.add(drafts=1, proposed=2, accepted=3)
    counts.clear()
    assert counts.metrics()["speculative_proposed_tokens_total"] == 0


def _window(counts: SpeculationCounts, rate: float) -> None:
    """One full window of proposed tokens at acceptance ``rate``, in steps of 8."""
    for _ in range(WINDOW_PROPOSED // 8):
        counts.add(drafts=2, proposed=8, accepted=round(8 * rate))


def test_acceptance_below_the_floor_warns_once_until_it_recovers(caplog):
    counts = SpeculationCounts()
    counts.watch_acceptance(0.3, "backend X")
    with caplog.at_level(logging.WARNING, logger="gen_backend_kit.speculation"):
        _window(counts, 0.5)
        assert not caplog.records and counts.metrics()["speculative_below_break_even"] == 0
        _window(counts, 0.125)
        _window(counts, 0.125)  # still below: no second warning
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 1 and "backend X" in warned[0] and "12% of the last" in warned[0]
        metrics = counts.metrics()
        assert metrics["speculative_below_break_even"] == 1
        assert metrics["speculative_recent_acceptance_rate"] == pytest.approx(0.125)
        counts.clear()  # a metrics clear does not re-arm it: the window is the backend's
        _window(counts, 0.125)
        assert len(caplog.records) == 1
        _window(counts, 0.5)  # recovered: re-armed
        assert counts.metrics()["speculative_below_break_even"] == 0
        _window(counts, 0.0)
        assert len(caplog.records) == 2


def test_a_floor_of_zero_never_warns(caplog):
    counts = SpeculationCounts()
    counts.watch_acceptance(0.0, "backend X")
    with caplog.at_level(logging.WARNING, logger="gen_backend_kit.speculation"):
        _window(counts, 0.0)
    assert not caplog.records and counts.metrics()["speculative_below_break_even"] == 0
