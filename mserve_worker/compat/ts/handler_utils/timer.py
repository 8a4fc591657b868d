"""TorchServe's ``ts.handler_utils.timer``: ``@timed`` on a handler's steps."""

from __future__ import annotations

import functools
import time
from typing import Any, Callable


def timed(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run the method; when the model config says ``handler: {profile: true}``, record its
    duration as the time metric ``ts_handler_<method name>`` in ms, as TorchServe does."""

    @functools.wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        context = getattr(self, "context", None)
        config = getattr(context, "model_yaml_config", None) or {}
        handler_config = config.get("handler") if isinstance(config, dict) else None
        if not (isinstance(handler_config, dict) and handler_config.get("profile")):
            return func(self, *args, **kwargs)
        started = time.perf_counter()
        result = func(self, *args, **kwargs)
        elapsed_ms = (time.perf_counter() - started) * 1000
        context.metrics.add_time(f"ts_handler_{func.__name__}", round(elapsed_ms, 2))
        return result

    return wrapper
