"""Kernel style: ``Kernel`` subclasses with ``on_kernel_start`` / ``on_task_invoke`` /
``on_kernel_shutdown`` (kernel-file.txt). Being written; see the adapter contract in loader.py."""

from __future__ import annotations

import inspect
from typing import Any


def claims(target: Any) -> bool:
    """A class with ``on_task_invoke(task_context)`` is a kernel."""
    return inspect.isclass(target) and callable(getattr(target, "on_task_invoke", None))


def load(target: Any, module: Any, context: Any) -> Any:
    from ..loader import HandlerLoadError

    raise HandlerLoadError("the kernel style is not available yet")
