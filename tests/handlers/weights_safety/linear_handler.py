"""BaseHandler's own loading (modelFile + serializedFile), rows of numbers in, scores out."""

import torch

from mserve_worker.sdk.base_handler import BaseHandler


class LinearHandler(BaseHandler):
    def preprocess(self, data):
        return torch.tensor(
            [row.get("data") or row.get("body") for row in data], dtype=torch.float32
        )

    def postprocess(self, inference_output):
        return [{"score": row[0]} for row in inference_output.tolist()]
