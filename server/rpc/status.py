"""gRPC status codes for our errors: the one table, TorchServe's choices.

A failure answers the gRPC status of its error class (the nearest class in the table along its
MRO), with the error's message, the same text as the REST error body's ``message``. An answer a
worker sent with an error status (a handler that set 404 itself, a handler error reported per
request) takes the code TorchServe gives that HTTP status; its body is the message.
"""

from __future__ import annotations

import grpc

from server.auth import Unauthorized
from server.errors import (
    ArchiveNotAllowed,
    BadRequest,
    ConfigError,
    DownloadFailed,
    DownloadTimedOut,
    DownloadTooLarge,
    InvalidModel,
    MethodNotAllowed,
    ModelAlreadyExists,
    ModelApiDisabled,
    ModelNotFound,
    ModelVersionNotFound,
    MserveError,
    PathNotFound,
    RequestTooLarge,
    ResponseTooLarge,
    ServiceUnavailable,
    TooManyRequests,
    WorkerTimeout,
)

Code = grpc.StatusCode

# Our error classes -> gRPC codes. Anything not listed (handler errors, dead workers, internal
# errors) is INTERNAL through MserveError.
CODES: dict[type[MserveError], grpc.StatusCode] = {
    Unauthorized: Code.UNAUTHENTICATED,  # TorchServe answers CANCELLED (see docs/migration.md)
    ModelNotFound: Code.NOT_FOUND,
    ModelVersionNotFound: Code.NOT_FOUND,
    PathNotFound: Code.NOT_FOUND,
    BadRequest: Code.INVALID_ARGUMENT,
    ConfigError: Code.INVALID_ARGUMENT,
    InvalidModel: Code.INVALID_ARGUMENT,  # TorchServe's ModelException on register
    DownloadFailed: Code.INVALID_ARGUMENT,  # TorchServe's DownloadArchiveException on register
    DownloadTimedOut: Code.DEADLINE_EXCEEDED,
    DownloadTooLarge: Code.RESOURCE_EXHAUSTED,
    ArchiveNotAllowed: Code.PERMISSION_DENIED,
    ModelApiDisabled: Code.PERMISSION_DENIED,  # TorchServe: PERMISSION_DENIED "Model API disabled"
    MethodNotAllowed: Code.UNIMPLEMENTED,
    ModelAlreadyExists: Code.ABORTED,  # TorchServe's code for 409
    TooManyRequests: Code.RESOURCE_EXHAUSTED,
    RequestTooLarge: Code.RESOURCE_EXHAUSTED,
    ResponseTooLarge: Code.RESOURCE_EXHAUSTED,
    ServiceUnavailable: Code.UNAVAILABLE,
    WorkerTimeout: Code.DEADLINE_EXCEEDED,
    MserveError: Code.INTERNAL,
}

# TorchServe's codes for the HTTP status of a worker's answer (its GRPCUtils); other 4xx are
# FAILED_PRECONDITION, other 5xx INTERNAL.
_HTTP = {
    400: Code.INVALID_ARGUMENT, 401: Code.UNAUTHENTICATED, 403: Code.PERMISSION_DENIED,
    404: Code.NOT_FOUND, 409: Code.ABORTED, 413: Code.RESOURCE_EXHAUSTED,
    416: Code.OUT_OF_RANGE, 429: Code.RESOURCE_EXHAUSTED, 499: Code.CANCELLED,
    501: Code.UNIMPLEMENTED, 503: Code.UNAVAILABLE, 504: Code.DEADLINE_EXCEEDED,
}  # fmt: skip

# A status message travels in a trailer; clients refuse metadata over 8 KiB by default, so a
# long message (a handler's traceback) is cut.
MAX_MESSAGE_CHARS = 4000


def code_of(error: MserveError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        code = CODES.get(cls)
        if code is not None:
            return code
    return Code.INTERNAL


def code_of_http(status: int) -> grpc.StatusCode:
    """The code for a worker's answer with HTTP status ``status`` (>= 400)."""
    code = _HTTP.get(status)
    if code is not None:
        return code
    return Code.FAILED_PRECONDITION if 400 <= status < 500 else Code.INTERNAL


def message(text: str) -> str:
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return f"{text[:MAX_MESSAGE_CHARS]} ... (cut: {len(text)} characters in all)"
