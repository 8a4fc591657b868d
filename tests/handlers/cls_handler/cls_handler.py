"""Handler-class style: one handler class, next to a helper class and an imported one."""

from collections import OrderedDict  # imported classes are not candidates

EVENTS = []


class Vocabulary:
    """A helper with neither handle nor initialize: not a handler class."""

    def __init__(self):
        self.words = OrderedDict()


class UpperHandler:
    def __init__(self):
        self.context = None
        self.initialize_calls = 0
        EVENTS.append("created")

    def initialize(self, context):
        self.initialize_calls += 1
        self.context = context
        EVENTS.append(("initialize", context.model_name))

    def handle(self, data, context):
        return [row["body"].upper() for row in data]

    def shutdown(self):
        EVENTS.append("shutdown")
