"""A Kernel subclass that forgot on_task_invoke."""

from server.workers.sdk.kernel import Kernel


class LazyKernel(Kernel):
    def on_kernel_start(self, kernel_context):
        pass
