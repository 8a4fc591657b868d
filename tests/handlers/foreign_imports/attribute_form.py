"""An mlrun model class reaching the base class as ``mlrun.serving.V2ModelServer``."""

import mlrun


class Quadrupler(mlrun.serving.V2ModelServer):
    def load(self):
        self.factor = 4

    def predict(self, request):
        return [x * self.factor for x in request["inputs"]]
