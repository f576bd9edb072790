"""Speculative decoding, backend side: refusing what a backend does not offer, and counting.

A backend that offers ``speculative`` (``SpeculativeConfig``) lists its methods in
``GenerationBackend.speculative_methods``; ``refuse_unoffered_speculation`` turns any other away
by name. ``SpeculationCounts`` holds what every speculating backend reports in
``get_logger_metrics()`` (zeros while speculation is off):

======================================  ===================================================
name                                    meaning
======================================  ===================================================
``speculative_drafts_total``            verifying steps of a row that had draft tokens
``speculative_proposed_tokens_total``   draft tokens proposed
``speculative_accepted_tokens_total``   of them, accepted by the target
``speculative_acceptance_rate``         accepted / proposed (0.0 before any)
``speculative_mean_accepted_length``    tokens a verifying step emits: 1 + accepted / drafts
                                        (vLLM's "mean acceptance length"; 0.0 before any)
``speculative_recent_acceptance_rate``  accepted / proposed over the last window of
                                        ``WINDOW_PROPOSED`` proposed tokens (not cleared)
``speculative_below_break_even``        1 while that rate is below the floor, else 0
======================================  ===================================================

**When speculation stops paying.** A verifying step costs about ``c`` plain decode steps (the
drafter's forwards, the target's pass over K + 1 positions; ``tools/bench/speculative.py``
measures ``c`` per batch size) and emits ``1 + K a`` tokens, ``a`` being the acceptance rate:
below ``a* = (c - 1) / K`` speculation is slower than plain decoding. ``watch_acceptance(floor)``
compares every window of ``WINDOW_PROPOSED`` proposed tokens with ``floor`` (the config's
``speculative.min_acceptance_rate``) and, the first time one falls below it, logs one warning
with the figures and what to do; it warns again only after a window at or above the floor.
The backend keeps speculating: turning it off means restarting the engines (seconds here,
minutes on GPUs) and the next drafter refit usually brings acceptance back, so the choice is
the trainer's (refit the drafter, lower ``num_speculative_tokens``, or build the backend
without ``speculative``); ``speculative_below_break_even`` says so on every metrics read.

**Where it never pays.** ``c`` grows with the batch: a verifying step of a large batch is
compute-bound, so ``a*`` nears 1 and no drafter reaches it (0.97 at batch 64 on 2 CPU cores).
``num_speculative_tokens_per_batch_size`` (vLLM's dynamic speculation) gives the draft tokens
of an engine step by the rows it holds, 0 for none, and ``draft_tokens_at`` reads it. A step
with 0 drafts is not free where a drafter model keeps a KV cache (vLLM runs the drafter's
forward over the step's tokens, so drafting can resume when the batch shrinks): 0 pays only
where that forward costs less than speculating loses. ``tools/bench/speculative.py`` measures
both per batch size and prints the schedule that follows.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from gen_interface.errors import GenerationConfigError

__all__ = [
    "DEFAULT_MIN_ACCEPTANCE_RATE",
    "SPECULATION_METRICS",
    "WINDOW_PROPOSED",
    "SpeculationCounts",
    "draft_tokens_at",
    "refuse_unoffered_speculation",
]

logger = logging.getLogger(__name__)

#: Proposed tokens per acceptance window of ``watch_acceptance``.
WINDOW_PROPOSED = 512
#: ``speculative.min_acceptance_rate`` when the config leaves it out: just below the smallest
#: break-even acceptance ``tools/bench/speculative.py`` measured (0.42 at batch 1 on 2 CPU
#: cores; gen-vllm's README), under which speculation loses at every batch size; 0 turns the
#: warning off.
DEFAULT_MIN_ACCEPTANCE_RATE = 0.3

#: The metric names ``SpeculationCounts.metrics`` gives.
SPECULATION_METRICS = (
    "speculative_recent_acceptance_rate",
    "speculative_below_break_even",
    "speculative_drafts_total",
    "speculative_proposed_tokens_total",
    "speculative_accepted_tokens_total",
    "speculative_acceptance_rate",
    "speculative_mean_accepted_length",
)


def refuse_unoffered_speculation(
    config: Mapping[str, Any], backend: str, offered: frozenset[str]
) -> None:
    """Raise unless ``config["speculative"]`` is None or names a method in ``offered``.

    Raises:
        GenerationConfigError: naming the method and what ``backend`` offers instead.
    """
    section = config.get("speculative")
    if not section:
        return
    method = section.get("method") if isinstance(section, Mapping) else None
    if method in offered:
        return
    offer = f"it offers {sorted(offered)}" if offered else "it offers no speculative decoding"
    raise GenerationConfigError(
        f"speculative.method {method!r} is set but {backend} does not offer it ({offer}); use "
        "backend 'vllm', or leave speculative out"
    )


def draft_tokens_at(section: Mapping[str, Any], batch_size: int) -> int:
    """The draft tokens a verifying step of ``batch_size`` rows proposes under the
    ``speculative`` ``section``: ``num_speculative_tokens``, or what its batch schedule
    (``num_speculative_tokens_per_batch_size``, validated) gives that size, as vLLM reads it:
    a size between two ranges or past the last takes the k of the range below it."""
    k = int(section["num_speculative_tokens"])
    schedule = section.get("num_speculative_tokens_per_batch_size")
    if not schedule:
        return k
    out = k
    for first, _last, tokens in schedule:
        if first > batch_size:
            break
        out = min(k, int(tokens))
    return out


class SpeculationCounts:
    """Thread-safe totals of drafts, proposed and accepted tokens since the last ``clear``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._floor = 0.0
        self._what = ""
        self._window = [0, 0]  # proposed, accepted in the window being filled
        self._recent: float | None = None  # the last full window's acceptance rate
        self._below = False  # the last full window was below the floor
        self.clear()

    def watch_acceptance(self, floor: float, what: str) -> None:
        """Warn once when a window's acceptance falls below ``floor`` (see the module); ``what``
        names the backend and its drafter in the warning. ``floor`` 0: never."""
        with self._lock:
            self._floor, self._what = floor, what

    def clear(self) -> None:
        with self._lock:
            self._drafts = self._proposed = self._accepted = 0

    def add(self, *, drafts: int, proposed: int, accepted: int) -> None:
        """``drafts`` verifying steps (one per row that had draft tokens) checked ``proposed``
        draft tokens and accepted ``accepted`` of them.

        Raises:
            ValueError: a count is negative, or more were accepted than proposed.
        """
        if min(drafts, proposed, accepted) < 0 or accepted > proposed:
            raise ValueError(
                f"speculation counts must satisfy 0 <= accepted <= proposed, got drafts {drafts}, "
                f"proposed {proposed}, accepted {accepted}"
            )
        with self._lock:
            self._drafts += drafts
            self._proposed += proposed
            self._accepted += accepted
            self._window[0] += proposed
            self._window[1] += accepted
            if self._window[0] < WINDOW_PROPOSED:
                return
            rate = self._recent = self._window[1] / self._window[0]
            self._window = [0, 0]
            below = rate < self._floor
            warn = below and not self._below
            self._below = below
        if warn:
            logger.warning(
                "%s: speculative decoding accepted %.0f%% of the last %d proposed tokens, below "
                "speculative.min_acceptance_rate %.0f%%, where it costs more than it saves; "
                "refit the drafter, lower num_speculative_tokens, or build the backend without "
                "speculative (this warning comes again only after acceptance recovers)",
                self._what,
                100 * rate,
                WINDOW_PROPOSED,
                100 * self._floor,
            )

    def metrics(self) -> dict[str, int | float]:
        """The ``SPECULATION_METRICS``, by name."""
        with self._lock:
            drafts, proposed, accepted = self._drafts, self._proposed, self._accepted
            recent, below = self._recent, self._below
        return {
            "speculative_recent_acceptance_rate": 0.0 if recent is None else recent,
            "speculative_below_break_even": int(below),
            "speculative_drafts_total": drafts,
            "speculative_proposed_tokens_total": proposed,
            "speculative_accepted_tokens_total": accepted,
            "speculative_acceptance_rate": accepted / proposed if proposed else 0.0,
            "speculative_mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
        }
