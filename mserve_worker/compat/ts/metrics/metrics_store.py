"""TorchServe's ``ts.metrics.metrics_store``: ``MetricsStore``, the class of ``context.metrics``
in TorchServe, constructed as TorchServe's is (``MetricsStore(request_ids, model_name)``), which
its handlers' tests do when they build a context of their own."""

from mserve_worker.context import Metrics


class MetricsStore(Metrics):
    """``context.metrics`` (mserve_worker.metrics.Metrics) made the way TorchServe makes its
    store: ``request_ids`` maps batch indexes to request ids (a single id, as some tests pass,
    stands for index 0); ``model_name`` is kept for the handler to read."""

    def __init__(self, request_ids=None, model_name=None, max_entries=1000):
        super().__init__(max_entries)
        if isinstance(request_ids, dict):
            self.set_request_ids(request_ids)
        elif request_ids is not None:
            self.set_request_ids({0: str(request_ids)})
        self.model_name = model_name


__all__ = ["MetricsStore"]
