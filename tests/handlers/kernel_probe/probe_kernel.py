"""A kernel that reports what it sees, for the tests of the kernel adapter.

Per task, the JSON body's "cmd" picks the behaviour: "skip" (set no output), "bad" (answer 400
through the task's own status), otherwise a report. On shutdown it writes the file named by the
model config's kernel attribute "shutdown_marker".
"""

import json

from mserve_worker.sdk.kernel import Kernel


class ProbeKernel(Kernel):
    def on_kernel_start(self, kernel_context):
        self.instance_id = kernel_context.get_instance_id()
        self.description = json.loads(kernel_context.get_model_description())
        self.batches = 0
        Kernel.log_warn("probe kernel started as instance " + self.instance_id)

    def on_task_invoke(self, task_context):
        self.batches += 1
        ids = []
        task = task_context
        while task is not None:
            ids.append(task.get_id())
            task = task.next()
        position = 0
        while task_context is not None:
            raw = task_context.get_input_data()
            body = json.loads(raw) if isinstance(raw, str) and raw[:1] in "{[" else None
            cmd = body.get("cmd") if isinstance(body, dict) else None
            if cmd == "bad":
                task_context.set_response_status(400, "Bad Request")
                task_context.set_output_data({"error": "bad input"})
            elif cmd != "skip":
                previous = task_context.prev()
                task_context.set_output_data(
                    {
                        "id": task_context.get_id(),
                        "version": task_context.get_version(),
                        "input_type": type(raw).__name__,
                        "input": raw if isinstance(raw, str) else len(raw),
                        "position": position,
                        "batch_ids": ids,
                        "prev_id": previous.get_id() if previous is not None else None,
                        "instance_id": self.instance_id,
                        "description": self.description,
                        "batches": self.batches,
                    }
                )
            position += 1
            task_context = task_context.next()

    def on_kernel_shutdown(self):
        Kernel.log_info("probe kernel shutting down")
        for attribute in self.description["attributes"]:
            if attribute.get("key") == "shutdown_marker":
                with open(attribute["value"], "w") as f:
                    f.write(self.instance_id)
