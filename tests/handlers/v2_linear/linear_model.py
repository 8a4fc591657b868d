"""A v2 model class in mlrun's documented form, unedited (``mlrun.serving`` is mserve's stand-in).

The model is a pickled dict of linear weights (the test writes it with a fixed seed) and a
labels file shipped as an extra file; ``threshold`` comes from the model config's ``params``.
"""

import json
import os
import pickle

import numpy as np
from mlrun.serving import V2ModelServer


class LinearModel(V2ModelServer):
    def load(self):
        model_file, extra_data = self.get_model(suffix=".pkl")
        with open(model_file, "rb") as f:
            self.model = pickle.load(f)
        self.weights = np.array(self.model["weights"], dtype=float)
        self.bias = float(self.model["bias"])
        self.labels = json.loads(extra_data["labels"].get())
        self.model_file = os.path.basename(model_file)
        self.extra_names = sorted(extra_data)
        self.threshold = self.get_param("threshold", 0.0)
        self.context.logger.info("linear model loaded", features=len(self.weights))

    def predict(self, request):
        events = np.array(request["inputs"], dtype=float)
        scores = events @ self.weights + self.bias
        self.set_metric("rows", len(events))
        return [
            {"score": float(s), "label": self.labels[str(int(s > self.threshold))]} for s in scores
        ]

    def explain(self, request):
        events = np.array(request["inputs"], dtype=float)
        return {"contributions": (events * self.weights).tolist(), "bias": self.bias}

    def postprocess(self, response):
        # which requests shared this call of the handler (mserve's batch), for the batch test
        response["batch_size"] = len(self.context.handler_context.request_ids)
        return response

    def op_describe(self, event):
        return {
            "path": event.path,
            "method": event.method,
            "id": event.id,
            "body": event.body,
            "fields": event.fields,
            "x_test": event.headers.get("x-test"),
            "model_file": self.model_file,
            "extra_data": self.extra_names,
            "threshold": self.threshold,
            "greeting": self.context.get_param("greeting"),
            "version": self.version,
            "ready": self.ready,
        }

    def op_teapot(self, event):
        return self.context.Response(
            body="short and stout",
            content_type="text/plain",
            status_code=418,
            headers={"X-Pot": "tea"},
        )
