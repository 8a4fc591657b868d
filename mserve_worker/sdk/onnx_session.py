"""ONNX models for ``BaseHandler``: a serialized file ending in ``.onnx`` is opened as an
onnxruntime ``InferenceSession``, as TorchServe's BaseHandler opens it: the CUDA provider first
(then the CPU's) when the worker has a GPU, the CPU provider alone otherwise, and as many
intra-op threads as the worker may use CPUs.

Runs inside a worker: standard library only at import time; onnxruntime (and numpy, which it
needs) are imported when a model is opened or run.
"""

from __future__ import annotations

import os
from typing import Any


def open_session(path: str, map_location: str | None, device_index: int | None) -> Any:
    """The ``InferenceSession`` of the ONNX file at ``path``; ImportError without onnxruntime."""
    import onnxruntime as ort

    providers: list[Any] = ["CPUExecutionProvider"]
    if map_location == "cuda":
        providers.insert(0, ("CUDAExecutionProvider", {"device_id": device_index or 0}))
    options = ort.SessionOptions()
    options.intra_op_num_threads = _usable_cpus()
    return ort.InferenceSession(path, sess_options=options, providers=providers)


def is_session(model: Any) -> bool:
    """Whether ``model`` is an onnxruntime session (BaseHandler's default inference runs it)."""
    return callable(getattr(model, "run", None)) and callable(getattr(model, "get_inputs", None))


def run(session: Any, batch: Any) -> Any:
    """Feed ``batch`` (a tensor or an array) to the session's first input; its first output,
    as a torch tensor."""
    import numpy as np
    import torch

    if isinstance(batch, torch.Tensor):
        batch = batch.detach().cpu().numpy()
    first_input = session.get_inputs()[0].name
    outputs = session.run(None, {first_input: np.asarray(batch)})
    return torch.from_numpy(np.asarray(outputs[0]))


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1
