"""MMS's custom-service shape: a class driven by a module-level handle function.

Named without a function (``model_handler``), the module's ``handle`` is the entry point, so the
class is initialised once, through ``handle(None, context)``, not created a second time.
"""

LOG = []


class ModelHandler:
    def __init__(self):
        self.initialized = False
        self.batch_size = 0

    def initialize(self, context):
        self.batch_size = context.system_properties["batch_size"]
        self.initialized = True
        LOG.append("initialize")

    def handle(self, data, context):
        return ["OK"] * len(data)


_service = ModelHandler()


def handle(data, context):
    if not _service.initialized:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
