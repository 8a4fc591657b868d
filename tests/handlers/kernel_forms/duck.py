"""A look-alike kernel that does not subclass Kernel: detected by its on_task_invoke."""


class DuckKernel:
    def on_task_invoke(self, task_context):
        while task_context is not None:
            task_context.set_output_data("quack " + task_context.get_input_data())
            task_context = task_context.next()
