"""Built-in ``object_detector`` (``--handler object_detector``): an image in, boxes out.

The model follows torchvision's detection API: it takes a batch of images (a stacked tensor, or a
list of tensors when their sizes differ) and returns one dict per image with ``boxes``
(``[x1, y1, x2, y2]``), ``labels`` and ``scores``. Each request gets a list of
``{label: box, "score": score}`` for the detections scoring at least ``threshold`` (model config
``handler: {threshold: 0.3}``), labels named through ``index_to_name.json`` when present. Images
are only converted to ``[0, 1]`` tensors: torchvision detectors normalise inside the model.
"""

from __future__ import annotations

from typing import Any

from .base_handler import BaseHandler, label_of
from .vision import VisionHandler


class ObjectDetector(VisionHandler):
    """To tensor only; detections above ``threshold``."""

    threshold = 0.5
    handler_options = (*VisionHandler.handler_options, "threshold")

    # Integrated gradients need one score per class, not detections: /explanations says this
    # handler does not explain (TorchServe's inherits one that fails inside captum).
    get_insights = BaseHandler.get_insights

    def postprocess(self, data: Any) -> list[Any]:
        results = []
        for detections in data:
            found = []
            boxes = detections["boxes"].tolist()
            labels = detections["labels"].tolist()
            scores = detections["scores"].tolist()
            for box, label, score in zip(boxes, labels, scores):
                if score >= self.threshold:
                    found.append({label_of(label, self.mapping): box, "score": score})
            results.append(found)
        return results
