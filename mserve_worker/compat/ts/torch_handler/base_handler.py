"""TorchServe's ``ts.torch_handler.base_handler``: mserve's ``BaseHandler``."""

from mserve_worker.sdk.base_handler import BaseHandler

__all__ = ["BaseHandler"]
