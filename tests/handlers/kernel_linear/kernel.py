"""A kernel file in the documented form (kernel-file.txt), with a tiny linear model instead of
resnet18; only the import line differs from the original SDK's."""

import json
import os

import torch
from torch import nn

from mserve_worker.sdk.kernel import Kernel


class MatchKernel(Kernel):
    def on_kernel_start(self, kernel_context):
        model_desc = json.loads(kernel_context.get_model_description())
        model_file = os.path.join(model_desc["model_path"], "linear.pt")
        self.model = nn.Linear(4, 3)
        self.model.load_state_dict(torch.load(model_file))
        self.model.eval()
        Kernel.log_info("on_kernel_start: instance " + kernel_context.get_instance_id())

    def on_task_invoke(self, task_context):
        task_context_vec = []
        while task_context != None:  # noqa: E711  (the documented loop, as written)
            task_context_vec.append(task_context)
            task_context = task_context.next()
        for task_context in task_context_vec:
            input_data = json.loads(task_context.get_input_data())
            req_id = input_data["id"]
            d = input_data["inputs"][0]
            data = torch.tensor(d["data"], dtype=torch.float32).unsqueeze(0)
            with torch.no_grad():
                outs = self.model(data)
            output_data = {
                "name": "output0",
                "datatype": "FP32",
                "shape": [1, 3],
                "data": outs.data[0].numpy().tolist(),
            }
            task_context.set_output_data(json.dumps({"id": req_id, "outputs": [output_data]}))

    def on_kernel_shutdown(self):
        Kernel.log_info("on_kernel_shutdown")


if __name__ == "__main__":
    kernel = MatchKernel()
    kernel.run()
