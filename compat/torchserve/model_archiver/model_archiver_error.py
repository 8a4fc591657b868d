"""``ModelArchiverError``: what every failure a caller can cause raises, as in TorchServe."""

from __future__ import annotations


class ModelArchiverError(Exception):
    """An archive could not be built from a ``ModelArchiverConfig``.

    The message is our archiver's (what failed, on which input, and the fix); ``code`` is the
    stable code of the ``archiver`` error it translates (``"input_not_found"``, ...), or
    ``"usage_error"`` for a config this package rejects itself."""

    def __init__(self, message: str, code: str = "usage_error") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
