"""TorchServe's ``ts.torch_handler.vision_handler``: mserve's ``VisionHandler``."""

from mserve_worker.sdk.vision import VisionHandler

__all__ = ["VisionHandler"]
