"""V2 model-server style: classes with ``load()`` and ``predict(request)``
(mlrun-v2-model-server.txt). Being written; see the adapter contract in loader.py."""

from __future__ import annotations

import inspect
from typing import Any


def claims(target: Any) -> bool:
    """A class with ``load()`` and ``predict(request)`` is a v2 model class."""
    return (
        inspect.isclass(target)
        and callable(getattr(target, "load", None))
        and callable(getattr(target, "predict", None))
    )


def load(target: Any, module: Any, context: Any) -> Any:
    from ..loader import HandlerLoadError

    raise HandlerLoadError("the v2-model style is not available yet")
