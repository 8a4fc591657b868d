"""TorchServe's test_handler_traceback_logging handler in shape: initialize fails five calls
deep, so each try's traceback names every frame."""


class FailingModel:
    def initialize(self, context):
        self.call1()

    def handle(self, data, context):
        return None

    def call1(self):
        self.call2()

    def call2(self):
        self.call3()

    def call3(self):
        self.call4()

    def call4(self):
        self.call5()

    def call5(self):
        assert False  # noqa: B011 (the line TorchServe's test looks for in the traceback)
