"""Prometheus metrics, under vLLM's names where vLLM has them (dashboards for ``vllm serve``
read them unchanged), plus the weight version and update times this server adds, and every
value of the backend's ``get_logger_metrics`` as ``gen:backend_<name>``, read at each scrape.

The speculative decoding metrics (``speculative_*``, gen-backend-kit's ``speculation``) are typed:
the three totals are counters, the acceptance rate and mean accepted length gauges, each with its
meaning as help; the totals are also exported under vLLM's names
(``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
``..._num_accepted_tokens_total``), so that vLLM's speculative decoding dashboards read them.

The backend's values are read on a thread of their own (``ServerMetrics.read_backend``), never
on the event loop: a backend whose read waits on a lock, or on another process, cannot stall
the requests in flight. ``/metrics`` and ``/health`` both read them that way."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["BACKEND_READ_TIMEOUT_S", "ServerMetrics"]

#: The longest a read of the backend's metrics may take before it counts as unanswered.
BACKEND_READ_TIMEOUT_S = 5.0

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 640)
_UPDATE_BUCKETS = (0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600)


class ServerMetrics:
    """One server's metrics, in a registry of its own (several servers may share a process).

    Args:
        model_name: the ``model_name`` label of every metric.
        backend_metrics: the backend's ``get_logger_metrics`` (None: the backend reports none).
        read_timeout_s: the longest ``read_backend`` waits for it.
    """

    def __init__(
        self,
        model_name: str,
        backend_metrics: Callable[[], Mapping[str, int | float]] | None = None,
        *,
        read_timeout_s: float = BACKEND_READ_TIMEOUT_S,
    ):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._read = backend_metrics
        self.read_timeout_s = read_timeout_s
        self._reader: ThreadPoolExecutor | None = None
        self._pending: asyncio.Future[Mapping[str, int | float]] | None = None

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            metric = Histogram(name, doc, list(labels), registry=self.registry, buckets=buckets)
            return metric.labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Requests being generated.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests held while paused.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self._finished = Counter(
            "vllm:request_success",
            "Finished rows by reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self._labels = labels
        self.rejections = counter(
            "vllm:admission_rejections", "Requests refused because too many were in flight."
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to a request's first token.", _LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Request latency.", _LATENCY_BUCKETS
        )
        self.weight_version = gauge("gen:weight_version", "The weight version in use.")
        self.update_seconds = histogram(
            "gen:weight_update_duration_seconds",
            "Weight update durations, start to commit or abort.",
            _UPDATE_BUCKETS,
        )

    def request_started(self, prompt_tokens: int) -> None:
        self.running.inc()
        self.prompt_tokens.inc(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def request_ended(self, seconds: float, generated: int, reasons: Sequence[str]) -> None:
        self.running.dec()
        self.e2e.observe(seconds)
        self.generation_tokens.inc(generated)
        for reason in reasons:
            self._finished.labels(**self._labels, finished_reason=reason).inc()

    def rejected(self) -> None:
        self.rejections.inc()

    async def read_backend(self) -> dict[str, int | float]:
        """The backend's ``get_logger_metrics()`` now (``{}`` when it reports none), read on
        this server's metrics thread so that the event loop does not wait on it. Callers that
        come while a read runs share it, so a backend slow to answer holds one thread, never
        more.

        Raises:
            TimeoutError: no answer within ``read_timeout_s`` (the read goes on; the next
                caller waits for the same one).
            Exception: what the backend's ``get_logger_metrics`` raised.
        """
        if self._read is None:
            return {}
        loop = asyncio.get_running_loop()
        pending = self._pending
        if pending is None or pending.done() or pending.get_loop() is not loop:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="gen-serve-metrics")
            pending = loop.run_in_executor(self._reader, self._read)
            self._pending = pending
        async with asyncio.timeout(self.read_timeout_s):
            return dict(await asyncio.shield(pending))

    def render(self, backend_values: Mapping[str, int | float] | None = None) -> bytes:
        """The Prometheus text of every metric, with ``backend_values`` (``read_backend``'s)
        as ``gen:backend_<name>`` (gauges, but for the typed speculative metrics)."""
        text = generate_latest(self.registry)
        if backend_values:
            text += generate_latest(_BackendMetrics(backend_values, self._labels))
        return text

    def close(self) -> None:
        """Stop the metrics thread (a read still running ends on its own)."""
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
            self._reader = None


class _BackendMetrics:
    """One reading of the backend's ``get_logger_metrics``, as metrics named
    ``gen:backend_<name>``: gauges, but for ``_TYPED``'s (characters Prometheus refuses in a
    name become ``_``; values that are not numbers are left out)."""

    def __init__(self, values: Mapping[str, int | float], labels: dict[str, str]):
        self._values = values
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        labels, label_values = list(self._labels), list(self._labels.values())
        for name, value in sorted(self._values.items()):
            if not isinstance(value, int | float):
                continue
            metric_name = f"gen:backend_{_INVALID.sub('_', name)}"
            typed = _TYPED.get(name)
            doc = typed.help if typed else f"the backend's get_logger_metrics()[{name!r}]"
            kind = CounterMetricFamily if typed and typed.counter else GaugeMetricFamily
            family = kind(metric_name, doc, labels=labels)
            family.add_metric(label_values, float(value))
            yield family
            if typed is not None and typed.vllm_name is not None:
                vllm_family = CounterMetricFamily(typed.vllm_name, typed.help, labels=labels)
                vllm_family.add_metric(label_values, float(value))
                yield vllm_family


@dataclass(frozen=True)
class _Typed:
    """How one of the backend's metrics is exported: a counter or a gauge, its help, and the
    name vLLM gives the same counter (None: vLLM has none)."""

    counter: bool
    help: str
    vllm_name: str | None = None


#: The backend metrics exported with a type and help of their own: gen-backend-kit's
#: ``speculation.SPECULATION_METRICS`` (every speculating backend reports them).
_TYPED: dict[str, _Typed] = {
    "speculative_drafts_total": _Typed(
        True,
        "Speculative decoding: verifying steps of a row that had draft tokens.",
        "vllm:spec_decode_num_drafts",
    ),
    "speculative_proposed_tokens_total": _Typed(
        True, "Speculative decoding: draft tokens proposed.", "vllm:spec_decode_num_draft_tokens"
    ),
    "speculative_accepted_tokens_total": _Typed(
        True,
        "Speculative decoding: draft tokens accepted by the target model.",
        "vllm:spec_decode_num_accepted_tokens",
    ),
    "speculative_acceptance_rate": _Typed(
        False, "Speculative decoding: accepted / proposed draft tokens (0 before any)."
    ),
    "speculative_mean_accepted_length": _Typed(
        False,
        "Speculative decoding: tokens a verifying step emits, 1 + accepted / drafts (0 before "
        "any).",
    ),
}


#: Characters a Prometheus metric name may not hold.
_INVALID = re.compile(r"[^a-zA-Z0-9_:]")
