"""A v2 model class (mlrun's contract) that chooses what model monitoring records: the row
count and the outputs' sum through ``logged_results``, a ``rows`` metric through ``set_metric``;
a request with ``"plain": true`` is recorded as it is; the input "boom" fails."""

from mlrun.serving import V2ModelServer


class Scorer(V2ModelServer):
    def load(self):
        self.scale = 2

    def predict(self, request):
        rows = request["inputs"]
        if "boom" in rows:
            raise ValueError("boom is not a number")
        self.set_metric("rows", len(rows))
        return [x * self.scale for x in rows]

    def logged_results(self, request, response, op):
        if request.get("plain"):
            return None, None
        return [len(request["inputs"])], [sum(response["outputs"])]
