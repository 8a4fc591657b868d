"""Two handler classes and no module-level handle: the loader cannot choose."""


class FirstHandler:
    def handle(self, data, context):
        return ["first"] * len(data)


class SecondHandler:
    def initialize(self, context):
        pass

    def handle(self, data, context):
        return ["second"] * len(data)
