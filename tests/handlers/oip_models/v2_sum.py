"""A v2 model class (mlrun style) whose predict gets decoded tensors by name on OIP requests."""

import numpy as np

from mserve_worker.sdk.v2_model import V2ModelServer


class SumModel(V2ModelServer):
    def load(self):
        self.ready = True

    def predict(self, request):
        inputs = request["inputs"]
        if isinstance(inputs, dict):  # OIP: {name: numpy array}
            x = inputs["x"]
            return {"total": x.sum(axis=-1), "dtype": np.array([str(x.dtype)], dtype=object)}
        return [sum(row) for row in inputs]  # mlrun's rows (v1 instances, legacy bodies)
