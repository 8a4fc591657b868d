"""Errors a handler raises on purpose to choose the answer its callers get.

Standard library only: the worker's runtime imports this to recognise them at the per-batch
boundary, before any handler is loaded.
"""

from __future__ import annotations


class PredictionException(Exception):
    """Fail the whole batch with ``error_code`` and ``message``, as TorchServe answers it.

    TorchServe's own name (``ts.utils.util.PredictionException``) is this class, so handlers that
    raise it keep their status codes: every request of the batch gets ``error_code`` and the body
    ``{"code": error_code, "type": "InternalServerException", "message": message}``.
    """

    def __init__(self, message: str, error_code: int = 500) -> None:
        self.message = message
        self.error_code = error_code
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.message} : {self.error_code}"
