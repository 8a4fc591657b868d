"""TorchServe's ``ts.metrics.metrics_store``: ``MetricsStore`` is ``context.metrics``'s class."""

from mserve_worker.context import Metrics as MetricsStore

__all__ = ["MetricsStore"]
