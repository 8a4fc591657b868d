"""TorchServe's ``ts.utils.util``: the helpers handlers import from it.

``PredictionException`` is mserve's own (the worker answers it with its status); the label
helpers are the ones mserve's built-in handlers use. PyYAML is imported only when
``get_yaml_config`` is called, as TorchServe needs it there too.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from typing import Any, Callable

from mserve_worker.sdk.base_handler import load_label_mapping, map_class_to_label
from mserve_worker.sdk.errors import PredictionException
from mserve_worker.sdk.pt2 import PT2Backend, check_valid_pt2_backend

__all__ = [
    "CLEANUP_REGEX",
    "PT2Backend",
    "PredictionException",
    "check_valid_pt2_backend",
    "deprecated",
    "get_yaml_config",
    "list_classes_from_module",
    "load_label_mapping",
    "map_class_to_label",
]

# HTML tags and entities, as TorchServe's text handlers strip them.
CLEANUP_REGEX = re.compile(r"<.*?>|&([a-z0-9]+|#[0-9]{1,6}|#x[0-9a-f]{1,6});")


def list_classes_from_module(module: Any, parent_class: type | None = None) -> list[type]:
    """The classes ``module`` defines itself (not those it imports), optionally only the
    subclasses of ``parent_class``; in name order, as ``inspect.getmembers`` lists them."""
    classes = [
        member
        for _, member in inspect.getmembers(module, inspect.isclass)
        if member.__module__ == module.__name__
    ]
    if parent_class is not None:
        classes = [c for c in classes if issubclass(c, parent_class)]
    return classes


def get_yaml_config(yaml_file_path: str) -> Any:
    """The YAML file's content (PyYAML must be installed in the model's environment)."""
    try:
        import yaml
    except ImportError:
        raise ImportError(
            f"get_yaml_config({yaml_file_path!r}) needs PyYAML in the model's environment; add "
            f"pyyaml to the model's requirements.txt"
        ) from None
    with open(yaml_file_path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def deprecated(
    version: str, replacement: str = "", klass: type = PendingDeprecationWarning
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a function so that each call warns it is deprecated in ``version``."""

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            warnings.warn(
                f"{func.__name__} is deprecated in {version} and moved to {replacement}",
                klass,
                stacklevel=2,
            )
            return func(*args, **kwargs)

        return wrapper

    return decorator
