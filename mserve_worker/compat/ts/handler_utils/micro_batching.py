"""TorchServe's ``ts.handler_utils.micro_batching``: ``MicroBatching``, which splits a handler's
batch into micro-batches and runs them through ``preprocess``, ``inference`` and ``postprocess``
as a pipeline, each step in its own threads, so that one micro-batch's preprocessing overlaps
another's inference.

A handler installs it as its ``handle`` and reads its settings from the model config's
``micro_batching`` section, as TorchServe's example does::

    class MicroBatchingHandler(ImageClassifier):
        def __init__(self):
            self.handle = MicroBatching(self)

        def initialize(self, ctx):
            super().initialize(ctx)
            config = ctx.model_yaml_config.get("micro_batching", {})
            if config.get("parallelism"):
                self.handle.parallelism = config["parallelism"]  # {"preprocess": 2, ...}
            self.handle.micro_batch_size = config.get("micro_batch_size", 1)

Where TorchServe's pipeline loses a step's thread to an exception (and the batch then waits
forever), here the exception fails that batch only, raised by ``handle`` once every micro-batch
of it is out of the pipeline, and the threads serve the next batch.

Standard library only; Python 3.8.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable

HANDLER_METHODS = ["preprocess", "inference", "postprocess"]
_POLL_S = 0.5  # how often an idle step thread looks whether it was asked to stop


class _Failed:
    """A micro-batch whose step raised: later steps pass it on, ``handle`` raises it."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class WorkerThread:
    """One thread of a step, and the event that stops it."""

    def __init__(self, event: threading.Event, thread: threading.Thread) -> None:
        self.event = event
        self.thread = thread


def _run_step(
    step: Callable[[Any], Any],
    inbox: queue.Queue,
    outbox: queue.Queue,
    local: threading.local,
    stop: threading.Event,
) -> None:
    while not stop.is_set():
        try:
            idx, value = inbox.get(timeout=_POLL_S)
        except queue.Empty:
            continue
        if not isinstance(value, _Failed):
            local.micro_batch_idx = idx
            try:
                value = step(value)
            except BaseException as exc:  # the batch fails, the thread serves on (a dead
                # thread would leave handle() waiting forever for this micro-batch)
                value = _Failed(exc)
            finally:
                local.micro_batch_idx = None
        outbox.put((idx, value))


class MicroBatching:
    """Split each batch into micro-batches of ``micro_batch_size`` requests and pipeline them
    through the handler's steps, ``parallelism[step]`` threads per step (1 by default)."""

    def __init__(
        self,
        parent_handler: Any,
        micro_batch_size: int = 1,
        parallelism: dict[str, int] | None = None,
    ) -> None:
        self.handler = parent_handler
        self.micro_batch_size = micro_batch_size
        self._parallelism: dict[str, int] = {}
        self.thread_groups: dict[str, list[WorkerThread]] = {m: [] for m in HANDLER_METHODS}
        self.thread_local_data = threading.local()
        self._lock = threading.Lock()  # one batch in the pipeline at a time
        # each step's outbox is the next step's inbox
        self.queues: dict[str, queue.Queue] = {}
        inbox: queue.Queue = queue.Queue()
        for method in HANDLER_METHODS:
            self.queues[method + "_in"] = inbox
            inbox = queue.Queue()
            self.queues[method + "_out"] = inbox
        self.parallelism = dict(parallelism or {})

    @property
    def parallelism(self) -> dict[str, int]:
        """Threads per step (a copy; assign a dict, even a partial one, to change it)."""
        return dict(self._parallelism)

    @parallelism.setter
    def parallelism(self, parallelism: dict[str, int]) -> None:
        unknown = [k for k in parallelism if k not in HANDLER_METHODS]
        if unknown:
            raise ValueError(
                f"micro_batching parallelism names {', '.join(map(repr, unknown))}; the steps "
                f"are {', '.join(HANDLER_METHODS)}"
            )
        for step, count in parallelism.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(
                    f"micro_batching parallelism.{step} must be a whole number of threads, at "
                    f"least 1; found {count!r}"
                )
        self._parallelism.update(parallelism)
        self._update_threads()

    def _update_threads(self) -> None:
        for method in HANDLER_METHODS:
            group = self.thread_groups[method]
            wanted = self._parallelism.get(method, 1)
            while len(group) < wanted:
                stop = threading.Event()
                thread = threading.Thread(
                    target=_run_step,
                    args=(
                        getattr(self.handler, method),
                        self.queues[method + "_in"],
                        self.queues[method + "_out"],
                        self.thread_local_data,
                        stop,
                    ),
                    name=f"micro-batching-{method}-{len(group)}",
                    daemon=True,  # never keeps a stopping worker alive
                )
                thread.start()
                group.append(WorkerThread(stop, thread))
            extra = group[wanted:]
            del group[wanted:]
            for worker in extra:  # all asked first: each takes up to _POLL_S to notice
                worker.event.set()
            for worker in extra:
                worker.thread.join()

    def shutdown(self) -> None:
        """Stop every step's threads (each finishes the micro-batch it holds)."""
        for group in self.thread_groups.values():
            for worker in group:
                worker.event.set()
            for worker in group:
                worker.thread.join()
            group.clear()

    def get_micro_batch_idx(self) -> int | None:
        """The index of the micro-batch the calling step thread works on (None elsewhere)."""
        return getattr(self.thread_local_data, "micro_batch_idx", None)

    def handle(self, data: list[Any]) -> list[Any]:
        """Run ``data`` through the pipeline; the postprocessed results in request order."""
        size = self.micro_batch_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"micro_batch_size must be a whole number >= 1, found {size!r}")
        with self._lock:
            inbox = self.queues[HANDLER_METHODS[0] + "_in"]
            outbox = self.queues[HANDLER_METHODS[-1] + "_out"]
            count = 0
            for start in range(0, len(data), size):
                inbox.put((count, data[start : start + size]))
                count += 1
            done = sorted((outbox.get() for _ in range(count)), key=lambda pair: pair[0])
        failed = next((value for _, value in done if isinstance(value, _Failed)), None)
        if failed is not None:
            raise failed.error
        return [result for _, results in done for result in results]

    def __call__(self, data: list[Any], context: Any) -> list[Any]:
        """The handler's ``handle(data, context)``: explanations and profiling as
        ``BaseHandler.handle`` does them, predictions through the pipeline; records
        ``HandlerTime``."""
        started = time.time()
        handler = self.handler
        handler.context = context
        describe = getattr(handler, "_is_describe", None)
        if os.environ.get("ENABLE_TORCH_PROFILER") and hasattr(handler, "_infer_with_profiler"):
            output, _ = handler._infer_with_profiler(data=data)
        elif callable(describe) and describe():
            output = [handler.describe_handle()]
        elif handler._is_explain():
            output = handler.explain_handle(handler.preprocess(data), data)
        else:
            output = self.handle(data)
        elapsed_ms = round((time.time() - started) * 1000, 2)
        context.metrics.add_time("HandlerTime", elapsed_ms, None, "ms")
        return output
