"""TorchServe's ``ts.context``: the ``context`` a handler gets, and one request's headers."""

from mserve_worker.context import Context, Metrics, RequestProcessor

__all__ = ["Context", "Metrics", "RequestProcessor"]
