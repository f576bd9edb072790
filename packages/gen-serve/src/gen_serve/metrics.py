"""Prometheus metrics, under vLLM's names where vLLM has them (dashboards for ``vllm serve``
read them unchanged), plus the weight version and update times this server adds, and every
value of the backend's ``get_logger_metrics`` as ``gen:backend_<name>``, read at each scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 640)
_UPDATE_BUCKETS = (0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600)


class ServerMetrics:
    """One server's metrics, in a registry of its own (several servers may share a process)."""

    def __init__(
        self,
        model_name: str,
        backend_metrics: Callable[[], Mapping[str, int | float]] | None = None,
    ):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        if backend_metrics is not None:
            self.registry.register(_BackendMetrics(backend_metrics, labels))

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

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _BackendMetrics:
    """The backend's ``get_logger_metrics``, read at each scrape, as gauges."""

    def __init__(self, read: Callable[[], Mapping[str, int | float]], labels: dict[str, str]):
        self._read = read
        self._labels = labels

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # the names are known only once the backend reports

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, value in sorted(self._read().items()):
            family = GaugeMetricFamily(
                f"gen:backend_{name}",
                f"the backend's get_logger_metrics()[{name!r}]",
                labels=list(self._labels),
            )
            family.add_metric(list(self._labels.values()), float(value))
            yield family
