"""The metrics port (8082): ``GET /metrics`` in Prometheus's text format, and the frontend's
metrics behind it."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from server.http import Connection, Request
from server.registry import Registry


class Metrics:
    """Prometheus metrics of the frontend; gauges are read from the registry at scrape time."""

    def __init__(self, registry: Registry) -> None:
        self.prom = CollectorRegistry()
        self.requests = Counter(
            "mserve_requests", "Inference requests answered", ["model", "version", "code"],
            registry=self.prom,
        )  # fmt: skip
        self.latency = Histogram(
            "mserve_request_latency_seconds", "Inference latency, frontend to frontend",
            ["model"], registry=self.prom,
        )  # fmt: skip
        self._registry = registry
        self._counters: dict[tuple[str, str, int], Any] = {}
        self._timers: dict[str, Any] = {}
        self.prom.register(self)  # type: ignore[arg-type]

    def answered(self, model: str, version: str, code: int, seconds: float | None) -> None:
        """Count one answer; label children are cached (``labels()`` costs more than ``inc()``)."""
        key = (model, version, code)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self.requests.labels(model, version, str(code))
        counter.inc()
        if seconds is not None:
            timer = self._timers.get(model)
            if timer is None:
                timer = self._timers[model] = self.latency.labels(model)
            timer.observe(seconds)

    def collect(self) -> Any:
        queue = GaugeMetricFamily("mserve_queue_depth", "Jobs waiting", labels=["model", "version"])
        workers = GaugeMetricFamily(
            "mserve_workers_ready", "Ready workers", labels=["model", "version"]
        )
        for mv in self._registry.all():
            queue.add_metric([mv.name, mv.version], mv.queued())
            workers.add_metric([mv.name, mv.version], mv.ready_workers())
        yield queue
        yield workers


class MetricsAPI:
    """The router of the metrics port: ``GET /metrics`` in Prometheus's text format."""

    api_name = ""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def route(self, conn: Connection, req: Request) -> None:
        if req.parts != ["metrics"]:
            raise req.not_found()
        req.allow("GET")
        content_type = "text/plain; version=0.0.4; charset=utf-8"
        conn.answer(req, 200, [["Content-Type", content_type]], generate_latest(self.metrics.prom))
