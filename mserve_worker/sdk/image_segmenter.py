"""Built-in ``image_segmenter`` (``--handler image_segmenter``): an image in, a class per pixel out.

TorchServe's steps and answer: resize the shorter side to 256, centre-crop 224, ImageNet
normalisation; the model returns ``(N, classes, H, W)`` scores, under ``"out"`` as torchvision's
segmentation models do (a plain tensor works too). Each request gets its ``H x W`` grid (224 x 224
for these sizes) of ``[class, probability]`` pairs: the most likely class of each pixel, as a
float, and its softmax probability. The model config may change the sizes under ``handler:``.
"""

from __future__ import annotations

from typing import Any

from .base_handler import BaseHandler
from .vision import IMAGENET_MEAN, IMAGENET_STD, VisionHandler


class ImageSegmenter(VisionHandler):
    """Resize 256, centre-crop 224, ImageNet normalisation; per-pixel softmax and argmax."""

    resize_size = 256
    crop_size = 224
    mean = IMAGENET_MEAN
    std = IMAGENET_STD

    # Integrated gradients need one score per class, not per-pixel scores: /explanations says this
    # handler does not explain (TorchServe's inherits one that fails inside captum).
    get_insights = BaseHandler.get_insights

    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(data, list):
            return super().inference(data, *args, **kwargs)
        # Sizes differ (a subclass without the crop): one image at a time.
        return [super().inference(image.unsqueeze(0), *args, **kwargs) for image in data]

    def postprocess(self, data: Any) -> list[Any]:
        import torch

        outputs = data if isinstance(data, list) else [data]
        grids = []
        for output in outputs:
            scores = output["out"] if isinstance(output, dict) else output
            best = torch.max(torch.softmax(scores, dim=1), dim=1)
            pairs = torch.stack([best.indices.to(best.values.dtype), best.values], dim=3)
            grids.extend(pairs.tolist())
        return grids
