"""TorchServe's ``ts.torch_handler.text_handler``: mserve's ``TextHandler``."""

from mserve_worker.sdk.text_handler import TextHandler

__all__ = ["TextHandler"]
