"""The server's error tree and the one table that maps errors to HTTP statuses.

API error bodies keep TorchServe's shape and words,
``{"code": 404, "type": "ModelNotFoundException", "message": ...}``, so existing clients keep
working: ``code`` comes from ``status``, ``type`` is the name of the exception TorchServe answers
the same failure with (its Java class), not our class name. Failures a worker reports (handler
error, dead worker, timeout, oversize answer) are all ``InternalServerException`` there, whatever
the status. Where TorchServe has no such answer (429, 413 request, 403), ``type`` follows its
pattern: what failed, then ``Exception``.
"""

from __future__ import annotations


class MserveError(Exception):
    """Base of every error the server raises on purpose."""

    status = 500
    type = "InternalServerException"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def headers(self) -> dict[str, str]:
        """Extra HTTP headers for this error's response."""
        return {}

    def body(self) -> dict[str, object]:
        return {"code": self.status, "type": self.type, "message": self.message}


class BadRequest(MserveError):
    status = 400
    type = "BadRequestException"


class ConfigError(MserveError):
    """Server config: unknown key, bad value (names the key and the source)."""

    status = 400
    type = "BadRequestException"


class ModelNotFound(MserveError):
    status = 404
    type = "ModelNotFoundException"


class Unauthorized(MserveError):
    """No key, a wrong key or an expired one (server/auth.py). TorchServe answers 400 with this
    type (and so does its layout: :data:`TORCHSERVE_ANSWERS`); 401 with ``WWW-Authenticate`` is
    what HTTP clients and proxies expect."""

    status = 401
    type = "InvalidKeyException"

    def __init__(self, message: str, realm: str, error: str | None) -> None:
        super().__init__(message)
        self.realm = realm
        self.error = error  # RFC 6750: "invalid_token" once a key was sent

    def headers(self) -> dict[str, str]:
        value = f'Bearer realm="{self.realm}"'
        if self.error:
            value += f', error="{self.error}"'
        return {"WWW-Authenticate": value}


class PathNotFound(MserveError):
    """No API at this path."""

    status = 404
    type = "ResourceNotFoundException"


class ModelVersionNotFound(MserveError):
    status = 404
    type = "ModelVersionNotFoundException"


class ModelAlreadyExists(MserveError):
    status = 409
    type = "ConflictStatusException"


class SequenceOfAnotherTenant(MserveError):
    """A request names an open sequence that another tenant opened: a sequence's state (the
    handler keeps it by the sequence id) is its opener's alone."""

    status = 409
    type = "ConflictStatusException"


class InvalidModel(MserveError):
    """The archive cannot be registered: bad archive, bad manifest, handler failed to load."""

    status = 400
    type = "InvalidModelException"


class ArchiveSignatureRefused(InvalidModel):
    """archive_signatures require: the archive is unsigned, its signature is not valid, its
    signer is not trusted, or its content is not what was signed (server/signatures.py)."""

    status = 403
    type = "ArchiveSignatureException"


class UnsafeWeights(InvalidModel):
    """A weights file would import globals off the allow-list when unpickled, and
    ``weights_scan`` is require (server/weights/policy.py)."""


class HandlerLoadFailed(InvalidModel):
    """A worker could not load the model's handler (it raised, or did not answer within the
    startup timeout): 400 here, TorchServe's 500 in its layout (:data:`TORCHSERVE_ANSWERS`)."""


class ArchiveNotAllowed(MserveError):
    """A registration ``url`` outside the model store and the allowed paths."""

    status = 403
    type = "ArchiveNotAllowedException"


class ServiceUnavailable(MserveError):
    """No worker can take the request (none started, or the model failed)."""

    status = 503
    type = "ServiceUnavailableException"


class SequenceExpired(ServiceUnavailable):
    """A request names a sequence that expired (``sequenceMaxIdleMSec``, ``sequenceTimeoutMSec``):
    TorchServe serves no more requests of it, and answers 503 ServiceUnavailableException."""


class LoadFailed(ServiceUnavailable):
    """A model with no worker was asked for and the worker started for it failed to load: the
    requests that waited for it get the load's error."""


class BudgetExhausted(ServiceUnavailable):
    """A model with no worker was asked for, and starting one would pass
    ``worker_memory_budget_mb`` or ``max_loaded_models`` with nothing idle left to evict."""


class TooManyRequests(MserveError):
    """The model's queue is full (``job_queue_size``): try again shortly. (TorchServe answers
    503 here; 429 with ``Retry-After`` tells a client that waiting helps.)"""

    status = 429
    type = "TooManyRequestsException"
    retry_after_s = 1

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class RequestTooLarge(MserveError):
    status = 413
    type = "RequestTooLargeException"


class ResponseTooLarge(MserveError):
    """The handler's answer is over ``max_response_size_bytes``; 413, as for requests."""

    status = 413
    type = "InternalServerException"


class WorkerDied(MserveError):
    """The worker running this request exited; the message names it and its exit code."""

    status = 500
    type = "InternalServerException"


class HandlerError(MserveError):
    """The handler raised, or returned the wrong number of results, for this batch."""

    status = 500
    type = "InternalServerException"


class WorkerTimeout(MserveError):
    """The batch exceeded ``response_timeout``; the worker was killed and is replaced."""

    status = 504
    type = "InternalServerException"


class RequestExpired(MserveError):
    """The request passed its deadline (the model's ``clientTimeoutInMills``, counted from its
    arrival): dropped from the queue, or its generation stopped."""

    status = 504
    type = "InternalServerException"


class InternalError(MserveError):
    status = 500


class MethodNotAllowed(MserveError):
    """The path exists, the method does not; ``Allow`` lists those that do."""

    status = 405
    type = "MethodNotAllowedException"

    def __init__(self, message: str, allowed: tuple[str, ...]) -> None:
        super().__init__(message)
        self.allowed = allowed

    def headers(self) -> dict[str, str]:
        return {"Allow": ", ".join(self.allowed)}


class ModelApiDisabled(MethodNotAllowed):
    """Registering or unregistering through the API while the model API is off
    (``enable_model_api``): 405 over HTTP, PERMISSION_DENIED over gRPC, as in TorchServe."""


class DigestMismatch(BadRequest):
    """The archive's sha256 is not the one the registration's ``sha256`` parameter pins."""


class DownloadFailed(MserveError):
    """A registration URL could not be fetched: the upstream answered an error status, refused
    the connection or broke off (TorchServe's exception for a failed archive download)."""

    status = 502
    type = "DownloadArchiveException"


class DownloadTimedOut(DownloadFailed):
    """The upstream did not connect or send data within ``download_timeout_s``, or the whole
    download took over ``download_total_timeout_s``."""

    status = 504


class DownloadTooLarge(DownloadFailed):
    """The archive behind a registration URL is over ``download_max_bytes``."""

    status = 413


# Where TorchServe answers the same failure differently, the TorchServe layout answers as it
# does (docs/migration.md): (status, type).
TORCHSERVE_ANSWERS: dict[type[MserveError], tuple[int, str]] = {
    HandlerLoadFailed: (500, "InternalServerException"),
    WorkerTimeout: (500, "InternalServerException"),
    Unauthorized: (400, "InvalidKeyException"),
}


def answer_as_torchserve() -> None:
    """Switch this process's answers to TorchServe's (the TorchServe layout's server calls it
    once at start, before any request): one table, applied where the classes define them."""
    for cls, (status, kind) in TORCHSERVE_ANSWERS.items():
        cls.status, cls.type = status, kind
