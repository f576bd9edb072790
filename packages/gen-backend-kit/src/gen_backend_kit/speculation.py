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
======================================  ===================================================
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from gen_interface.errors import GenerationConfigError

__all__ = ["SPECULATION_METRICS", "SpeculationCounts", "refuse_unoffered_speculation"]

#: The metric names ``SpeculationCounts.metrics`` gives, in order.
SPECULATION_METRICS = (
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


class SpeculationCounts:
    """Thread-safe totals of drafts, proposed and accepted tokens since the last ``clear``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.clear()

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

    def metrics(self) -> dict[str, int | float]:
        """The ``SPECULATION_METRICS``, by name."""
        with self._lock:
            drafts, proposed, accepted = self._drafts, self._proposed, self._accepted
        return {
            "speculative_drafts_total": drafts,
            "speculative_proposed_tokens_total": proposed,
            "speculative_accepted_tokens_total": accepted,
            "speculative_acceptance_rate": accepted / proposed if proposed else 0.0,
            "speculative_mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
        }
