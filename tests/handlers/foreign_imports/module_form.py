"""An mlrun model class importing ``from mlrun.serving.v2_serving import V2ModelServer``."""

from mlrun.serving.v2_serving import V2ModelServer


class Tripler(V2ModelServer):
    def load(self):
        self.factor = 3

    def predict(self, request):
        return [x * self.factor for x in request["inputs"]]
