"""A class that fits two styles: a handler class (handle) and a v2 model class (load + predict)."""


class Both:
    def initialize(self, context):
        self.loaded = True

    def handle(self, data, context):
        return [{"via": "handle"} for _ in data]

    def load(self):
        pass

    def predict(self, request):
        return {"via": "predict"}
