"""An ImageClassifier subclass that overrides only preprocess: it classifies the mirror image."""

import io

import torch
from PIL import Image

from mserve_worker.sdk.image_classifier import ImageClassifier


class MirrorClassifier(ImageClassifier):
    def preprocess(self, data):
        images = []
        for row in data:
            image = row.get("data") or row.get("body")
            image = Image.open(io.BytesIO(image)).convert("RGB")
            images.append(self.transform(image.transpose(Image.FLIP_LEFT_RIGHT)))
        return torch.stack(images)
