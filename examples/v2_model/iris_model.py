"""An iris classifier as a v2 model class: load() reads the model, predict() answers requests.

Written as for mlrun's model server, unedited: inside mserve's workers ``mlrun.serving`` provides
``V2ModelServer``.
"""

# ruff: noqa: B905  (model environments may be Python 3.8, whose zip() has no strict=)
import json
import math

from mlrun.serving.v2_serving import V2ModelServer


class IrisClassifier(V2ModelServer):
    def load(self):
        """Read the weights (model.json, the serialized file) and the class names (extra file)."""
        model_file, extra_data = self.get_model(suffix=".json")
        with open(model_file) as f:
            model = json.load(f)
        self.weights, self.bias = model["weights"], model["bias"]
        self.classes = json.loads(extra_data["classes"].get())
        self.top_k = self.get_param("top_k", 1)
        self.context.logger.info("iris model loaded", classes=len(self.classes))

    def predict(self, request):
        """One answer per row of four measurements: the top_k classes and their probabilities."""
        return [self._top(self._probabilities(row)) for row in request["inputs"]]

    def explain(self, request):
        """Each feature's contribution to each class's score, per row."""
        return [
            {name: [w * x for w, x in zip(ws, row)] for name, ws in zip(self.classes, self.weights)}
            for row in request["inputs"]
        ]

    def op_classes(self, event):
        """A custom operation: POST /v2/models/iris/classes."""
        return {"classes": self.classes, "top_k": self.top_k}

    def _probabilities(self, row):
        scores = [sum(w * x for w, x in zip(ws, row)) + b for ws, b in zip(self.weights, self.bias)]
        top = max(scores)
        exps = [math.exp(s - top) for s in scores]
        return [e / sum(exps) for e in exps]

    def _top(self, probabilities):
        ranked = sorted(zip(self.classes, probabilities), key=lambda p: -p[1])[: self.top_k]
        return [{"class": name, "probability": round(p, 4)} for name, p in ranked]
