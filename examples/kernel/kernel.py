"""A model kernel for mserve: a linear classifier over four measurements (iris-like).

Written as kernel files are for other inference services, unedited: inside mserve's workers
``redhareapi`` provides ``Kernel``.
The class names come from the model config's kernel attributes.
"""

import json
import os

import torch
from redhareapi import Kernel
from torch import nn


class IrisKernel(Kernel):
    def on_kernel_start(self, kernel_context):
        model_desc = json.loads(kernel_context.get_model_description())
        weights = os.path.join(model_desc["model_path"], model_desc["weight_path"], "linear.pt")
        self.model = nn.Linear(4, 3)
        self.model.load_state_dict(torch.load(weights))
        self.model.eval()
        attributes = {a["key"]: a["value"] for a in model_desc["attributes"]}
        self.labels = attributes.get("labels", "0,1,2").split(",")
        Kernel.log_info(f"{model_desc['name']} {model_desc['tag']} ready on instance "
                        f"{kernel_context.get_instance_id()}")  # fmt: skip

    def on_task_invoke(self, task_context):
        # Run the batch's valid rows through the model at once, then answer each task.
        tasks, rows = [], []
        while task_context is not None:
            try:
                request = json.loads(task_context.get_input_data())
                row = [float(x) for x in request["inputs"][0]["data"]]
                if len(row) != 4:
                    raise ValueError(f"expected 4 numbers, got {len(row)}")
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                # One caller's bad input answers that caller only (mserve's set_response_status).
                task_context.set_response_status(400, "Bad Request")
                task_context.set_output_data({"error": f"bad request: {exc!r}"})
            else:
                tasks.append((task_context, request.get("id", task_context.get_id())))
                rows.append(row)
            task_context = task_context.next()
        if not rows:
            return
        with torch.no_grad():
            probabilities = torch.softmax(self.model(torch.tensor(rows)), dim=1).tolist()
        for i, (task, req_id) in enumerate(tasks):
            p = probabilities[i]
            best = max(range(len(p)), key=p.__getitem__)
            output = {"name": "output0", "datatype": "FP32", "shape": [1, 3], "data": p}
            task.set_output_data(
                json.dumps({"id": req_id, "label": self.labels[best], "outputs": [output]})
            )

    def on_kernel_shutdown(self):
        Kernel.log_info("on_kernel_shutdown")


if __name__ == "__main__":
    kernel = IrisKernel()
    kernel.run()
