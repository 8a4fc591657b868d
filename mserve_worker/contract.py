"""What the loader and the SDK's style adapters share: the handler styles, the one-call shape
every loaded handler takes (:class:`LoadedHandler`), the error for an unusable entry point and
the helpers adapters use to create and call user code.

A module of its own so that an adapter (:mod:`mserve_worker.sdk`) never imports the loader that
imports it. Runs inside the model's environment: standard library only, Python 3.8+, nothing
done at import time.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .coroutines import settle

MODULE_FUNCTION = "module-function"
HANDLER_CLASS = "handler-class"
CLASS_INSTANCE = "class-instance"
KERNEL = "kernel"
HOOKS = "hooks"
V2_MODEL = "v2-model"
# What --handler-style accepts ("auto" = detect); keep archiver.handler_spec.HANDLER_STYLES equal.
STYLES = (MODULE_FUNCTION, HANDLER_CLASS, KERNEL, HOOKS, V2_MODEL)


class HandlerLoadError(Exception):
    """The handler entry point cannot be found or used; the message is for the model's author."""


class LoadedHandler:
    """The handler, whatever its style, behind one call: ``handle(batch, context) -> list``."""

    def __init__(
        self,
        style: str,
        entry: Callable[[Any, Any], Any],
        instance: Any = None,
        module: Any = None,
        on_shutdown: Callable[[], Any] | None = None,
    ) -> None:
        self.style = style
        self.instance = instance
        self.module = module
        self._entry = entry
        self._on_shutdown = on_shutdown

    def handle(self, batch: list[Any], context: Any) -> list[Any] | None:
        """Call the handler with the whole batch and return what it returned, unchecked.

        An empty batch is answered with ``[]`` without calling the handler, since function-style
        handlers read an empty ``data`` as their initialisation call. An ``async def`` handler's
        coroutine is awaited on the worker's event loop (:mod:`.coroutines`).
        """
        if not batch:
            return []
        result = self._entry(batch, context)
        if type(result) is list:
            return result
        return settle(result, getattr(context, "_mserve_abandoned", None))

    @property
    def is_async(self) -> bool:
        """Whether ``handle`` is an ``async def`` (TorchServe's async worker contract): its
        batches may run at once (mserve_worker/inflight.py)."""
        return inspect.iscoroutinefunction(self._entry)

    def shutdown(self) -> None:
        """Run the style's stop hook, else the handler instance's ``shutdown()`` if it has one."""
        stop = self._on_shutdown or getattr(self.instance, "shutdown", None)
        if callable(stop):
            stop()

    def __repr__(self) -> str:
        return f"LoadedHandler(style={self.style!r}, entry={self._entry!r})"


def create_instance(cls: type, label: str) -> Any:
    """``cls()``, or a clear error when its ``__init__`` needs arguments we cannot give."""
    try:
        inspect.signature(cls).bind()
    except TypeError:
        raise HandlerLoadError(
            f"handler class {label!r} cannot be created without arguments: "
            f"__init__{inspect.signature(cls)}"
        ) from None
    except ValueError:
        pass  # no signature to inspect (a class implemented in C); just try it
    return cls()


def accepted_keywords(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The part of ``kwargs`` that ``fn`` takes (all of it when it has ``**kwargs``), checked
    to bind: a ``TypeError`` names what is missing. Adapters pass options a user's function may
    declare only some of (``init_hook(model_path)``, a model class's ``__init__``)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return dict(kwargs)  # no signature to inspect (implemented in C): offer everything
    if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in signature.parameters}
    signature.bind(**kwargs)
    return kwargs
