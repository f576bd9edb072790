"""What a backend did since its metrics were last cleared: NeMo RL's ``get_logger_metrics`` /
``clear_logger_metrics``, counted once in the base for every backend.

Names follow Prometheus' conventions so an exporter can publish them as they are: units in the
name, counters end in ``_total``. Every value is a plain ``int`` or ``float``:

========================================  ===============================================
name                                      meaning
========================================  ===============================================
``generate_calls_total``                  calls of generate, generate_async, generate_stream
``rows_generated_total``                  rows returned (cut short ones included)
``tokens_generated_total``                generated tokens returned
``rows_truncated_total``                  rows that stopped for length
``rows_cut_short_total``                  rows ended early by a weight update (``"abort"``)
``rows_running``, ``rows_running_peak``   rows of calls in progress: now, and the most at once
``row_seconds_mean``, ``row_seconds_p99``  from a call's start to each row's end
``time_to_first_token_seconds_mean``,     from a call's start to each row's first token, for
``time_to_first_token_seconds_p99``       rows streamed token by token (``generate_stream``)
``tokens_per_second``                     tokens returned / seconds during which rows ran
``weight_version``                        the weights generating now
``tokens_versions_behind_{k}_total``      tokens made by weights ``k`` versions older than
                                          the newest announced when their row ended
``rows_refused_stale_total``              rows refused by ``max_weight_staleness``
``rows_waited_stale_total``               rows that waited for an update to start under it
``refits_total``                          committed weight updates
``refit_seconds_mean``, ``..._max``       from ``start_weight_update`` to the commit
``refit_{phase}_seconds_total``           the committed updates' time per phase: ``begin``
                                          (pausing the engines), ``load`` (inside loads),
                                          ``commit`` (verifying and resuming); what is left
                                          of ``refit_seconds`` is the trainer's own time
``refit_bytes_total``                     bytes of the weights the committed updates carried
``refit_sent_bytes_total``                bytes that crossed the transport for them: whole
                                          tensors' bytes, and deltas' encoded bytes
``refit_tensors_total``                   tensors the committed updates carried
``refit_delta_tensors_total``             of them, sent as deltas
``refit_delta_share``                     the last committed update's tensors sent as
                                          deltas / its tensors (0.0 without one)
``refit_delta_ratio``                     the last committed update's sent bytes / the
                                          bytes of the weights it carried (1.0 whole)
========================================  ===============================================

Backends may add their own (gen-vllm: ``replica_{i}_tokens_generated_total`` per replica, and
``prefix_cache_queries_total`` / ``prefix_cache_hits_total``: prompt tokens of generated rows,
and those vLLM's prefix caches held).
Counting costs a lock and a few additions per row (no Python work per token).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence

from gen_interface.weights.handles import LoadSize

from gen_backend_kit.outputs import RowResult

__all__ = ["REFIT_PHASES", "CallCount", "GenerationMetrics"]

#: The phases of a weight update timed separately (as vLLM's RL routes report theirs).
REFIT_PHASES = ("begin", "load", "commit")

#: Most recent samples kept for the p99s (a ring: old samples drop off).
_SAMPLES = 4096


class GenerationMetrics:
    """Thread-safe counters and gauges of one backend."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._busy_since: float | None = None
        self._weight_version = 0
        self.clear()

    def clear(self) -> None:
        """Start counting anew; gauges (rows running, weight version) keep their values."""
        with self._lock:
            self._counts: dict[str, int] = {}
            self._row_seconds: list[float] = []
            self._first_token_seconds: list[float] = []
            self._refit_seconds: list[float] = []
            self._refit_phase_seconds = dict.fromkeys(REFIT_PHASES, 0.0)
            self._last_refit: LoadSize | None = None
            self._busy_seconds = 0.0
            self._peak = self._running
            if self._busy_since is not None:
                self._busy_since = time.perf_counter()

    # ---- what the base reports -----------------------------------------------------------

    def call_started(self, rows: int) -> float:
        """A call of ``rows`` rows starts; returns its start time (for ``row_finished``)."""
        now = time.perf_counter()
        with self._lock:
            self._add("generate_calls_total", 1)
            if self._running == 0:
                self._busy_since = now
            self._running += rows
            self._peak = max(self._peak, self._running)
        return now

    def call_ended(self, rows_left: int) -> None:
        """A call ends; ``rows_left`` of its rows never finished (failed or abandoned)."""
        self._leave(rows_left)

    @contextlib.contextmanager
    def call(self, rows: int, newest: Callable[[], int]) -> Iterator[CallCount]:
        """Count one call of ``rows`` rows: ``count.row(result)`` as each row comes back."""
        count = CallCount(self, self.call_started(rows), newest)
        try:
            yield count
        finally:
            self.call_ended(rows - count.rows)

    def row_finished(
        self, started: float, row: RowResult, newest: int, first_token_at: float | None = None
    ) -> None:
        """``row`` came back, ``started`` being its call's start and ``newest`` the newest
        weight version announced."""
        now = time.perf_counter()
        tokens = len(row.token_ids)
        by_version = (
            Counter(row.weight_versions) if row.weight_versions else {row.weight_version: tokens}
        )
        with self._lock:
            self._add("rows_generated_total", 1)
            self._add("tokens_generated_total", tokens)
            self._add("rows_truncated_total", int(row.truncated))
            self._add("rows_cut_short_total", int(row.cut_short))
            for version, count in by_version.items():
                self._add(f"tokens_versions_behind_{max(newest - version, 0)}_total", count)
            _sample(self._row_seconds, now - started)
            if first_token_at is not None:
                _sample(self._first_token_seconds, first_token_at - started)
        self._leave(1)

    def stale(self, *, refused: bool, rows: int) -> None:
        """``rows`` were refused by the staleness bound, or waited for an update under it."""
        with self._lock:
            self._add("rows_refused_stale_total" if refused else "rows_waited_stale_total", rows)

    def refit_committed(
        self,
        seconds: float,
        phase_seconds: Mapping[str, float],
        nbytes: int,
        size: LoadSize | None = None,
    ) -> None:
        """An update committed after ``seconds``, ``phase_seconds`` of them in each of
        ``REFIT_PHASES``, carrying ``nbytes`` of weights; ``size``: its tensors, deltas and
        bytes sent (default: ``nbytes`` sent whole, tensors not counted)."""
        size = size if size is not None else LoadSize(0, 0, nbytes, nbytes)
        with self._lock:
            self._add("refits_total", 1)
            self._add("refit_bytes_total", nbytes)
            self._add("refit_sent_bytes_total", size.sent_bytes)
            self._add("refit_tensors_total", size.tensors)
            self._add("refit_delta_tensors_total", size.deltas)
            self._last_refit = size
            for phase in REFIT_PHASES:
                self._refit_phase_seconds[phase] += phase_seconds.get(phase, 0.0)
            _sample(self._refit_seconds, seconds)

    def set_weight_version(self, version: int) -> None:
        with self._lock:
            self._weight_version = version

    # ---- what a loop reads ---------------------------------------------------------------

    def snapshot(self, extra: Mapping[str, int | float] | None = None) -> dict[str, int | float]:
        """Every metric, with ``extra`` (a backend's own) added."""
        with self._lock:
            counts = dict(self._counts)
            busy = self._busy_seconds
            if self._busy_since is not None:
                busy += time.perf_counter() - self._busy_since
            out: dict[str, int | float] = {
                name: counts.get(name, 0)
                for name in (
                    "generate_calls_total",
                    "rows_generated_total",
                    "tokens_generated_total",
                    "rows_truncated_total",
                    "rows_cut_short_total",
                    "rows_refused_stale_total",
                    "rows_waited_stale_total",
                    "refits_total",
                    "refit_bytes_total",
                    "refit_sent_bytes_total",
                    "refit_tensors_total",
                    "refit_delta_tensors_total",
                )
            }
            last = self._last_refit
            out["refit_delta_share"] = last.deltas / last.tensors if last and last.tensors else 0.0
            out["refit_delta_ratio"] = (
                last.sent_bytes / last.whole_bytes if last and last.whole_bytes else 1.0
            )
            out.update({k: v for k, v in counts.items() if k.startswith("tokens_versions_behind")})
            for phase, phase_seconds in self._refit_phase_seconds.items():
                out[f"refit_{phase}_seconds_total"] = phase_seconds
            out["rows_running"] = self._running
            out["rows_running_peak"] = self._peak
            out["weight_version"] = self._weight_version
            out["tokens_per_second"] = out["tokens_generated_total"] / busy if busy > 0 else 0.0
            for name, samples in (
                ("row_seconds", self._row_seconds),
                ("time_to_first_token_seconds", self._first_token_seconds),
            ):
                out[f"{name}_mean"] = sum(samples) / len(samples) if samples else 0.0
                out[f"{name}_p99"] = _p99(samples)
            refits = self._refit_seconds
            out["refit_seconds_mean"] = sum(refits) / len(refits) if refits else 0.0
            out["refit_seconds_max"] = max(refits, default=0.0)
        out.update(extra or {})
        return out

    # ---- internals -----------------------------------------------------------------------

    def _add(self, name: str, value: int) -> None:
        self._counts[name] = self._counts.get(name, 0) + value

    def _leave(self, rows: int) -> None:
        if rows <= 0:
            return
        with self._lock:
            self._running = max(self._running - rows, 0)
            if self._running == 0 and self._busy_since is not None:
                self._busy_seconds += time.perf_counter() - self._busy_since
                self._busy_since = None


class CallCount:
    """The rows of one call, as they come back (``GenerationMetrics.call``)."""

    def __init__(self, metrics: GenerationMetrics, started: float, newest: Callable[[], int]):
        self.metrics = metrics
        self.started = started
        self.newest = newest
        self.rows = 0
        self._first_token: dict[int, float] = {}

    def token(self, index: int) -> None:
        """Row ``index`` streamed a token (the first one times its first token)."""
        self._first_token.setdefault(index, time.perf_counter())

    def row(self, result: RowResult, index: int | None = None) -> None:
        self.rows += 1
        # a streamed row's first token; one streamed whole arrived with its end
        first = None if index is None else self._first_token.get(index, time.perf_counter())
        self.metrics.row_finished(self.started, result, self.newest(), first)


def _sample(samples: list[float], value: float) -> None:
    if len(samples) >= _SAMPLES:
        del samples[0]
    samples.append(value)


def _p99(samples: Sequence[float]) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
