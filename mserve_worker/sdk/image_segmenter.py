"""Built-in ``image_segmenter`` (``--handler image_segmenter``): an image in, a class per pixel out.

The model returns ``(N, classes, H, W)`` scores, or a dict holding them under ``"out"`` as
torchvision's segmentation models do. Each request gets its ``H x W`` grid of class indexes (the
argmax over classes). Images are normalised with the ImageNet mean and std and keep their size;
images of different sizes in one batch go through the model one at a time.
"""

from __future__ import annotations

from typing import Any

from .vision import IMAGENET_MEAN, IMAGENET_STD, VisionHandler


class ImageSegmenter(VisionHandler):
    """ImageNet normalisation, no resize; per-pixel argmax."""

    mean = IMAGENET_MEAN
    std = IMAGENET_STD

    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(data, list):
            return super().inference(data, *args, **kwargs)
        outputs = []  # different sizes: one image at a time
        for image in data:
            outputs.append(super().inference(image.unsqueeze(0), *args, **kwargs))
        return outputs

    def postprocess(self, data: Any) -> list[Any]:
        outputs = data if isinstance(data, list) else [data]
        grids = []
        for output in outputs:
            scores = output["out"] if isinstance(output, dict) else output
            grids.extend(scores.argmax(dim=1).tolist())
        return grids
