"""TorchServe's ``ts.torch_handler.text_classifier``: mserve's ``TextClassifier``."""

from mserve_worker.sdk.text_classifier import TextClassifier

__all__ = ["TextClassifier"]
