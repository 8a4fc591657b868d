"""TorchServe's ``ts.torch_handler.image_classifier``: mserve's ``ImageClassifier``."""

from mserve_worker.sdk.image_classifier import ImageClassifier

__all__ = ["ImageClassifier"]
