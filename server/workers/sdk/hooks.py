"""Hooks + driver style: ``init_hook`` / ``preprocess`` / ``postprocess`` functions run around a
driver (kibernetika-serving.txt). Being written; see the adapter contract in loader.py."""

from __future__ import annotations

from typing import Any

HOOK_NAMES = ("init_hook", "preprocess", "postprocess")


def claims(module: Any) -> bool:
    """A module defining any hook name (a function, or a list of them for a pipeline)."""
    return any(getattr(module, name, None) is not None for name in HOOK_NAMES)


def load(target: Any, module: Any, context: Any) -> Any:
    from ..loader import HandlerLoadError

    raise HandlerLoadError("the hooks style is not available yet")
