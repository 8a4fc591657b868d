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
    status is the node's own (its handler's error, 503 with no worker, 504 past timeout-ms)."""

    type = "InternalServerException"

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status
