"""A Kernel subclass that forgot on_task_invoke."""

from mserve_worker.sdk.kernel import Kernel


class LazyKernel(Kernel):
    def on_kernel_start(self, kernel_context):
        pass
