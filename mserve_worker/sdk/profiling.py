"""TorchServe's ``ENABLE_TORCH_PROFILER``: with that environment variable set (to anything but
empty), ``BaseHandler.handle`` runs each batch's steps under ``torch.profiler`` and writes a
Chrome trace (``<host>_<pid>.<ns>.pt.trace.json``, what TensorBoard's profiler plugin and
``chrome://tracing`` open) per batch.

As in TorchServe, the handler's ``profiler_args`` (set in its ``__init__``) are
``torch.profiler.profile``'s keyword arguments; left empty, they profile the CPU (and CUDA where
torch has it) with shapes recorded, and write to ``pytorch_profiler/<model name>`` under the
temporary folder: ``/tmp/pytorch_profiler/<model>`` as in TorchServe, or the model's scratch
folder where the sandbox confines the worker (its ``TMPDIR``). Each step is a
``record_function`` named ``preprocess``, ``inference``, ``postprocess`` (or ``explain``), and
the ten steps that took the most CPU time are logged as a table.

Runs inside a worker: standard library only at import time; torch is imported when profiling.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

ENV_VAR = "ENABLE_TORCH_PROFILER"
_log = logging.getLogger(__name__)


def enabled() -> bool:
    """Whether the worker's environment asks for profiling (read per call, as TorchServe)."""
    return bool(os.environ.get(ENV_VAR))


def profiler_args(handler: Any) -> dict[str, Any]:
    """The handler's ``profiler_args``, completed with the defaults and kept on the handler
    (so a subclass can read what was used, as in TorchServe)."""
    from torch import profiler

    args = getattr(handler, "profiler_args", None)
    if not isinstance(args, dict):
        args = {}
    if not args:
        import torch

        activities = [profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(profiler.ProfilerActivity.CUDA)
        args.update(activities=activities, record_shapes=True)
    if "on_trace_ready" not in args:
        folder = os.path.join(tempfile.gettempdir(), "pytorch_profiler", _model_name(handler))
        args["on_trace_ready"] = profiler.tensorboard_trace_handler(folder)
        _log.info("Saving chrome trace to : %s", folder)  # TorchServe's words
    handler.profiler_args = args
    return args


def profiled(handler: Any, data: list[Any], explain: bool) -> tuple[Any, Any]:
    """Run the handler's steps over ``data`` under the profiler: (output, the profile)."""
    from torch import profiler

    with profiler.profile(**profiler_args(handler)) as prof:
        with profiler.record_function("preprocess"):
            model_input = handler.preprocess(data)
        rejected = getattr(handler, "_rejected", None) or {}
        accepted = [row for i, row in enumerate(data) if i not in rejected]
        if not accepted:
            output: Any = []
        elif explain:
            with profiler.record_function("explain"):
                output = handler.explain_handle(model_input, accepted)
        else:
            with profiler.record_function("inference"):
                inferred = handler.inference(model_input)
            with profiler.record_function("postprocess"):
                output = handler.postprocess(inferred)
    _log.info("%s", prof.key_averages().table(sort_by="cpu_time_total", row_limit=10))
    return output, prof


def _model_name(handler: Any) -> str:
    manifest = getattr(handler, "manifest", None) or {}
    name = (manifest.get("model") or {}).get("modelName") if isinstance(manifest, dict) else None
    if not name:
        name = getattr(getattr(handler, "context", None), "model_name", "") or ""
    return str(name)
