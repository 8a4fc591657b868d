"""The server's error tree and the one table that maps errors to HTTP statuses.

API error bodies keep TorchServe's shape ``{"code": 404, "type": "ModelNotFound", "message": ...}``
so existing clients keep working; ``type`` is the class name, ``code`` comes from ``status``.
"""

from __future__ import annotations


class MserveError(Exception):
    """Base of every error the server raises on purpose."""

    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def type(self) -> str:
        return type(self).__name__

    def headers(self) -> dict[str, str]:
        """Extra HTTP headers for this error's response."""
        return {}

    def body(self) -> dict[str, object]:
        return {"code": self.status, "type": self.type, "message": self.message}


class BadRequest(MserveError):
    status = 400


class ConfigError(MserveError):
    """Server config: unknown key, bad value (names the key and the source)."""

    status = 400


class ModelNotFound(MserveError):
    status = 404


class ModelVersionNotFound(MserveError):
    status = 404


class ModelAlreadyExists(MserveError):
    status = 409


class InvalidModel(MserveError):
    """The archive cannot be registered: bad archive, bad manifest, handler failed to load."""

    status = 400


class ArchiveNotAllowed(MserveError):
    """A registration ``url`` outside the model store and the allowed paths."""

    status = 403


class ServiceUnavailable(MserveError):
    """No worker can take the request (none started, or the model failed)."""

    status = 503


class TooManyRequests(MserveError):
    """The model's queue is full (``job_queue_size``): try again shortly."""

    status = 429
    retry_after_s = 1

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class RequestTooLarge(MserveError):
    status = 413


class ResponseTooLarge(MserveError):
    """The handler's answer is over ``max_response_size_bytes``; 413, as for requests."""

    status = 413


class WorkerDied(MserveError):
    """The worker running this request exited; the message names it and its exit code."""

    status = 500


class HandlerError(MserveError):
    """The handler raised, or returned the wrong number of results, for this batch."""

    status = 500


class WorkerTimeout(MserveError):
    """The batch exceeded ``response_timeout``; the worker was killed and is replaced."""

    status = 504


class InternalError(MserveError):
    status = 500


class MethodNotAllowed(MserveError):
    """The path exists, the method does not; ``Allow`` lists those that do."""

    status = 405

    def __init__(self, message: str, allowed: tuple[str, ...]) -> None:
        super().__init__(message)
        self.allowed = allowed

    def headers(self) -> dict[str, str]:
        return {"Allow": ", ".join(self.allowed)}
