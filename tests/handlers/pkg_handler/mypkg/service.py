"""Dotted-module entry points: a class, an instance of it, and a plain callable object."""


class Service:
    def __init__(self):
        self.initialized_with = []
        self.stopped = False

    def initialize(self, context):
        self.initialized_with.append(context)

    def handle(self, data, context):
        return [{"index": i, "model": context.model_name} for i in range(len(data))]

    def shutdown(self):
        self.stopped = True


service = Service()


class _Doubler:
    def __init__(self):
        self.calls = []

    def __call__(self, data, context):
        self.calls.append(data)
        if data is None:
            return None
        return [row["body"] * 2 for row in data]


plain_callable = _Doubler()

NOT_CALLABLE = 42
