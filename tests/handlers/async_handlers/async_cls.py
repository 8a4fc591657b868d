"""TorchServe's async worker test handler, in shape: a ``BaseHandler`` subclass whose
``handle`` is ``async def`` and runs the sync steps itself, recording ``HandlerTime``."""

import asyncio
import time

from ts.torch_handler.base_handler import BaseHandler


class AsyncDoubler(BaseHandler):
    def initialize(self, context):
        self.context = context
        self.initialized = True

    async def handle(self, data, context):
        start_time = time.time()
        await asyncio.sleep(0.01)
        output = self.postprocess(self.preprocess(data))
        context.metrics.add_time(
            "HandlerTime", round((time.time() - start_time) * 1000, 2), None, "ms"
        )
        return output

    def preprocess(self, data):
        return [row.get("body") for row in data]

    def postprocess(self, data):
        return [2 * x for x in data]
