"""TorchServe's ONNX test handler, in shape: a ``BaseHandler`` subclass that runs the session
``BaseHandler`` opened (``self.model.run``) on its input named ``modelInput``, here with each
request's numbers and answering the model's outputs."""

import numpy as np
from ts.torch_handler.base_handler import BaseHandler


class ONNXHandler(BaseHandler):
    def handle(self, data, context):
        batch = np.array([row.get("body") for row in data], dtype=np.float32)
        (outputs,) = self.model.run(None, {"modelInput": batch})
        return outputs.tolist()
