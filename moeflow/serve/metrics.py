"""Prometheus metrics of ``moeflow serve`` (``GET /metrics``, the text format), on a registry of
the app's own: two apps in one process (the tests) never share or collide, and nothing lands in
``prometheus_client``'s global registry.

What the HTTP layer counts and times itself:

- ``moeflow_http_requests_total{endpoint, status}``: every answered request (a refusal too),
  counted by ``CountAnswers``, an ASGI middleware (other paths count as ``other``: a scan of
  random URLs makes no new series);
- ``moeflow_time_to_first_token_seconds``: from the engine accepting a request to its first
  token, and ``moeflow_inter_token_latency_seconds``: between two tokens of one request
  (histograms). Both are read on the engine thread when the token is known (``Engine`` calls a
  request's callback then), so the HTTP loop's own delay is not in them.

What the engine knows, read from ``Engine.stats()`` at each scrape (a collector, so a value is
never stale): ``moeflow_queue_length`` (requests waiting for a slot), ``moeflow_running_requests``,
``moeflow_slots``, ``moeflow_batch_occupancy`` (running / slots), and the counters
``moeflow_prompt_tokens_total``, ``moeflow_generation_tokens_total``,
``moeflow_engine_requests_total`` (accepted), ``moeflow_engine_rejected_total`` (queue full) and
``moeflow_engine_finished_total{reason}``.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["ServeMetrics", "CountAnswers", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text exposition format

# seconds: a tiny model on a CPU answers in milliseconds, a large offloaded one in seconds
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _EngineCollector:
    """The engine's gauges and counters, read from ``stats()`` when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], object]) -> None:
        self._stats = stats

    def describe(self) -> list:
        return []  # nothing to describe ahead: the registry must not call stats() at registration

    def collect(self):  # type: ignore[no-untyped-def]
        s = self._stats()
        for name, doc, value in (
                ("moeflow_queue_length", "requests waiting for a decode slot", s.queued),
                ("moeflow_running_requests", "requests holding a decode slot", s.running),
                ("moeflow_slots", "decode slots (--max-concurrency)", s.slots),
                ("moeflow_batch_occupancy", "running requests / decode slots", s.running / s.slots)):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
                ("moeflow_prompt_tokens", "prompt tokens of accepted requests", s.prompt_tokens_total),
                ("moeflow_generation_tokens", "tokens generated (end-of-sequence ids included)",
                 s.generated_tokens_total),
                ("moeflow_engine_requests", "requests the engine accepted", s.requests_total),
                ("moeflow_engine_rejected", "requests refused because the queue was full", s.rejected_total)):
            yield CounterMetricFamily(name, doc, value=value)
        finished = CounterMetricFamily("moeflow_engine_finished", "requests ended, by finish reason",
                                       labels=["reason"])
        for reason, count in sorted(s.finished.items()):
            finished.add_metric([reason], count)
        yield finished


class ServeMetrics:
    """The metrics of one app (module docstring); ``stats``: the engine's ``stats`` method."""

    def __init__(self, stats: Callable[[], object]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("moeflow_http_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("moeflow_time_to_first_token_seconds", "from a request's acceptance to its first "
                              "token", buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("moeflow_inter_token_latency_seconds", "between two tokens of a request",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(stats))

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text of every metric (the engine's read now)."""
        return generate_latest(self.registry)


class CountAnswers:
    """ASGI middleware counting every answer by endpoint and status
    (``moeflow_http_requests_total``): a plain wrapper of ``send`` (Starlette's
    ``BaseHTTPMiddleware`` would stand between a stream and its disconnect). An exception that
    escapes the app is a 500 (Starlette's outermost middleware answers it), a request left
    without an answer a 499 (the client went away)."""

    def __init__(self, app, *, metrics: ServeMetrics, endpoints: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
        answered = []

        async def counting_send(message) -> None:  # type: ignore[no-untyped-def]
            if message["type"] == "http.response.start":
                answered.append(message["status"])
                self.metrics.answered(endpoint, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not answered:
                answered.append(500)
                self.metrics.answered(endpoint, 500)
            raise
        finally:
            if not answered:  # the client went away before any answer (a disconnected wait)
                self.metrics.answered(endpoint, 499)
