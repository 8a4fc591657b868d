"""Overriding one step of a built-in handler: answer with the best class only.

A handler written for TorchServe imports ``ts.torch_handler.image_classifier`` instead, and runs
unedited: mserve's workers provide that name too.
"""

import torch

from mserve_worker.sdk.image_classifier import ImageClassifier


class Top1Classifier(ImageClassifier):
    def postprocess(self, data):
        probabilities = torch.softmax(data, dim=1)
        prob, index = probabilities.max(dim=1)
        return [
            {"label": self.mapping[str(i)], "probability": round(p, 4)}
            for p, i in zip(prob.tolist(), index.tolist())  # noqa: B905 (py3.8 envs: no strict)
        ]
