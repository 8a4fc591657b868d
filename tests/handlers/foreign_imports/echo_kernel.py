"""A kernel file as written for its own server: ``from redhareapi import Kernel``, unedited."""

import json

from redhareapi import Kernel


class EchoKernel(Kernel):
    def on_kernel_start(self, kernel_context):
        self.name = json.loads(kernel_context.get_model_description())["name"]
        Kernel.log_info("on_kernel_start " + self.name)

    def on_task_invoke(self, task_context):
        while task_context is not None:
            data = json.loads(task_context.get_input_data())
            task_context.set_output_data(json.dumps({"model": self.name, "echo": data}))
            task_context = task_context.next()


if __name__ == "__main__":
    kernel = EchoKernel()
    kernel.run()
