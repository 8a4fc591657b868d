"""What the metrics observe of the models, and what one model version adds to TorchServe's
metrics (:class:`ModelStats`: a few floats per request, no label lookups, on the prediction
path).

The models report to the metrics and are read by them through the shapes below; the metrics
import nothing of server/models/, so supervision depends on metrics and never the other way
round.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from mserve_worker.protocol import MetricEntry, RequestItem


class AnsweredJob(Protocol):
    """A request a worker answered (server/models/batching.py's Job)."""

    @property
    def item(self) -> RequestItem: ...
    @property
    def enqueued_at(self) -> float: ...
    @property
    def sent_at(self) -> float: ...


class ObservedSettings(Protocol):
    """The settings of a model version the scrape reads (server/config/model_settings.py)."""

    @property
    def min_workers(self) -> int: ...
    @property
    def job_queue_size(self) -> int: ...


class ObservedModel(Protocol):
    """A model version as the scrape reads it (server/models/version.py's ModelVersion)."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def stats(self) -> ModelStats: ...
    @property
    def settings(self) -> ObservedSettings: ...
    def queued(self) -> int: ...
    def ready_workers(self) -> int: ...
    def worker_states(self) -> list[str]:
        """The state of each of its workers (STARTING, READY, BUSY, STOPPING, STOPPED)."""
        ...

    def pending(self) -> int: ...
    def worker_load_ms(self) -> list[tuple[str, float]]:
        """(worker id, its load time) of each worker that has loaded."""
        ...

    def worker_sandboxes(self) -> list[tuple[str, dict[str, Any] | None]]:
        """(worker id, how it confined itself) of each ready worker."""
        ...


class ObservedResidency(Protocol):
    """The server's residency keeper (server/models/residency.py), for its gauges."""

    @property
    def memory_bytes(self) -> int: ...
    @property
    def budget_bytes(self) -> int | None: ...
    def loaded_models(self) -> int: ...
    @property
    def warm(self) -> ObservedWarmTier: ...


class ObservedWarmTier(Protocol):
    """The warm tier (server/models/warm.py), for its gauges."""

    @property
    def budget_bytes(self) -> int | None: ...
    @property
    def bytes(self) -> int: ...
    @property
    def entries(self) -> Mapping[str, Any]: ...
    @property
    def parked(self) -> int: ...


class StatsSink(Protocol):
    """Where a model version's figures go (server_metrics.py's Metrics): its Prometheus series
    and TorchServe's metric log lines, as the metrics mode says."""

    log_frontend: bool
    log_model: bool

    def log_ts(
        self, name: str, unit: str, value: float, dims: tuple[tuple[str, str], ...]
    ) -> None: ...
    def log_model_line(
        self, name: str, unit: str, value: float, dims: Iterable[tuple[str, str]], ids: str
    ) -> None: ...
    def request_cancelled(self, name: str, version: str, reason: str) -> None: ...
    def builtin_series(self, name: str, model_name: str) -> list[float] | None: ...
    def handler_entries(
        self, model_name: str, entries: list[MetricEntry], jobs: Sequence[AnsweredJob]
    ) -> None: ...


def worker_name(model_name: str, model_version: str, worker_id: str) -> str:
    """TorchServe's WorkerName dimension."""
    return f"W-{worker_id}-{model_name}_{model_version}"


class ModelStats:
    """What one model version adds to TorchServe's metrics. Request counts are kept apart for
    requests that named the version and those that did not, which TorchServe labels
    ``model_version="default"``."""

    __slots__ = (
        "_handler",
        "_prediction",
        "metrics",
        "name",
        "named",
        "send_s",
        "unnamed",
        "version",
        "worker_thread_ms",
    )

    def __init__(self, metrics: StatsSink | None, name: str, version: str) -> None:
        self.metrics = metrics
        self.name = name
        self.version = version
        # [requests, latency in microseconds, queue latency in microseconds]
        self.named = [0.0, 0.0, 0.0]
        self.unnamed = [0.0, 0.0, 0.0]
        self.worker_thread_ms: float | None = None
        self.send_s = 0.0  # how long the frontend took to send the last batch
        self._handler: list[float] | None = None
        self._prediction: list[float] | None = None

    def arrived(self, named: bool) -> list[float]:
        """A request for this model version (``ts_inference_requests_total``); its counts."""
        counts = self.named if named else self.unnamed
        counts[0] += 1
        metrics = self.metrics
        if metrics is not None and metrics.log_frontend:
            metrics.log_ts(
                "ts_inference_requests_total", "Count", 1,
                (("model_name", self.name), ("model_version", self.label(named))),
            )  # fmt: skip
        return counts

    def label(self, named: bool) -> str:
        return self.version if named else "default"

    def cancelled(self, reason: str) -> None:
        """A request stopped before its answer was complete (see Job.cancel)."""
        if self.metrics is not None:
            self.metrics.request_cancelled(self.name, self.version, reason)

    def batch_done(
        self, handler_ms: float | None, entries: list[MetricEntry], jobs: Sequence[AnsweredJob],
        settle_s: float,
    ) -> None:  # fmt: skip
        """A batch was answered: the handler's time and metrics, the frontend's own time."""
        self.worker_thread_ms = (self.send_s + settle_s) * 1000
        metrics = self.metrics
        if metrics is None:
            return
        if metrics.log_frontend:
            metrics.log_ts("WorkerThreadTime", "Milliseconds", self.worker_thread_ms, ())
        if handler_ms is not None:
            if self._handler is None:
                self._handler = metrics.builtin_series("HandlerTime", self.name)
                self._prediction = metrics.builtin_series("PredictionTime", self.name)
            if self._handler is not None:
                self._handler[0] = handler_ms
            if self._prediction is not None:
                self._prediction[0] = handler_ms
            if metrics.log_model:
                dims = (("ModelName", self.name), ("Level", "Model"))
                ids = request_ids(jobs)
                metrics.log_model_line("HandlerTime", "ms", handler_ms, dims, ids)
                metrics.log_model_line("PredictionTime", "ms", handler_ms, dims, ids)
        if entries:
            metrics.handler_entries(self.name, entries, jobs)


def request_ids(jobs: Sequence[AnsweredJob]) -> str:
    return ",".join(job.item.request_id for job in jobs)
