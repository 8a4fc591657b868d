"""An mlrun model class importing ``from mlrun.serving import V2ModelServer``, unedited."""

from mlrun.serving import V2ModelServer


class Doubler(V2ModelServer):
    def load(self):
        self.factor = 2

    def predict(self, request):
        return [x * self.factor for x in request["inputs"]]
