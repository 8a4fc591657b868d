"""Built-in ``image_classifier`` (``--handler image_classifier``): an image in, top-k classes out.

A handler that subclassed TorchServe's ``ImageClassifier`` changes its import line to
``from mserve_worker.sdk.image_classifier import ImageClassifier``. Each request gets one
``{label: probability}`` object with its ``topk`` most likely classes, best first, named through
the archive's ``index_to_name.json`` when it has one. The model config may set ``topk``,
``resize_size``, ``crop_size``, ``mean`` and ``std`` under ``handler:``.
"""

from __future__ import annotations

from typing import Any

from .base_handler import map_class_to_label
from .vision import IMAGENET_MEAN, IMAGENET_STD, VisionHandler


class ImageClassifier(VisionHandler):
    """Resize 256, centre-crop 224, ImageNet normalisation; softmax; top-k."""

    resize_size = 256
    crop_size = 224
    mean = IMAGENET_MEAN
    std = IMAGENET_STD
    topk = 5
    handler_options = (*VisionHandler.handler_options, "topk")

    def set_max_result_classes(self, topk: int) -> None:
        """How many classes each answer lists (TorchServe's name for it)."""
        self.topk = topk

    def get_max_result_classes(self) -> int:
        return self.topk

    def postprocess(self, data: Any) -> list[Any]:
        import torch

        probabilities = torch.softmax(data, dim=1)
        k = min(self.topk, probabilities.shape[1])
        probs, classes = torch.topk(probabilities, k, dim=1)
        return map_class_to_label(probs.tolist(), self.mapping, classes.tolist())
