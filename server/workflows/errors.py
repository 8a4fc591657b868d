"""The workflow errors, with the status and ``type`` TorchServe answers them with."""

from __future__ import annotations

from server.errors import MserveError


class WorkflowNotFound(MserveError):
    status = 404
    type = "WorkflowNotFoundException"


class InvalidWorkflow(MserveError):
    """A ``.war`` that cannot be registered: its archive, manifest, spec or DAG."""

    status = 400
    type = "InvalidWorkflowException"


class WorkflowAlreadyExists(MserveError):
    status = 409
    type = "ConflictStatusException"


class NodeFailed(MserveError):
    """A node of a workflow's DAG failed a prediction: the request fails, naming the node. The
    status is the node's own (its handler's error, 503 with no worker, 504 past timeout-ms). A
    node refused with 429 (its model's queue full, the tenant over its quota) passes on its
    ``Retry-After``: the workflow's client is told when to try again, as a model's would be."""

    type = "InternalServerException"

    def __init__(self, message: str, status: int, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": self.retry_after}
