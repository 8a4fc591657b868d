"""A kernel whose on_task_invoke takes no task context."""

from mserve_worker.sdk.kernel import Kernel


class NoArgKernel(Kernel):
    def on_task_invoke(self):
        pass
