"""TorchServe's ``ts.torch_handler.object_detector``: mserve's ``ObjectDetector``."""

from mserve_worker.sdk.object_detector import ObjectDetector

__all__ = ["ObjectDetector"]
