"""An ImageClassifier subclass that overrides only postprocess (TorchServe's documented pattern;
the import line is the one change). Reports the batch size so tests can see batching."""

import torch

from mserve_worker.sdk.image_classifier import ImageClassifier


class Top1Classifier(ImageClassifier):
    def postprocess(self, data):
        probabilities = torch.softmax(data, dim=1)
        prob, index = probabilities.max(dim=1)
        return [
            {"label": self.mapping[str(i)], "probability": p, "batch": len(data)}
            for p, i in zip(prob.tolist(), index.tolist(), strict=True)
        ]
