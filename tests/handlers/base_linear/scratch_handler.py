"""TorchServe's "handler written from scratch" form: its own __init__ (no super().__init__()),
a TorchScript model loaded in initialize, and handle choosing prediction or explanation."""

import os

import torch

from mserve_worker.sdk.base_handler import BaseHandler


class ModelHandler(BaseHandler):
    def __init__(self):
        self._context = None
        self.initialized = False
        self.explain = False
        self.target = 0

    def initialize(self, context):
        self._context = context
        self.manifest = context.manifest
        model_dir = context.system_properties.get("model_dir")
        serialized_file = self.manifest["model"]["serializedFile"]
        model_pt_path = os.path.join(model_dir, serialized_file)
        if not os.path.isfile(model_pt_path):
            raise RuntimeError("Missing the model.pt file")
        self.model = torch.jit.load(model_pt_path)
        self.initialized = True

    def preprocess(self, data):
        rows = [row.get("data") or row.get("body") for row in data]
        return torch.tensor(rows, dtype=torch.float32)

    def inference(self, model_input):
        return self.model.forward(model_input)

    def postprocess(self, inference_output):
        return [{"scores": row} for row in inference_output.tolist()]

    def handle(self, data, context):
        model_input = self.preprocess(data)
        if not self._is_explain():
            model_output = self.inference(model_input)
            model_output = self.postprocess(model_output)
        else:
            model_output = self.explain_handle(model_input, data)
        return model_output

    def get_insights(self, tensor_data, raw_data, target):
        return [{"target": target, "input": raw_data} for _ in range(len(tensor_data))]
