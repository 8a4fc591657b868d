"""TorchServe's ``ts.torch_handler.image_segmenter``: mserve's ``ImageSegmenter``, also under
TorchServe's original misspelling ``ImangeSegmenter``."""

from mserve_worker.sdk.image_segmenter import ImageSegmenter

ImangeSegmenter = ImageSegmenter

__all__ = ["ImageSegmenter", "ImangeSegmenter"]
