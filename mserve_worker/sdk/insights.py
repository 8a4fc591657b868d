"""captum for the built-in handlers' explanations: imported by the first explanation, not before.

TorchServe's vision and text handlers import captum when their module loads, so a model
environment without it cannot even serve predictions. Here only ``/explanations`` needs it, and
``import captum.attr`` (about half a second: it pulls in matplotlib) is paid by the first
explanation instead of every worker start. Standard library only at import time.
"""

from __future__ import annotations

from typing import Any

from .errors import PredictionException

# Integration steps per input, as TorchServe's vision handler (captum's default is 50).
IG_STEPS = 15


def captum_attr(owner: str) -> Any:
    """``captum.attr``; a missing (or broken) captum is a NotImplementedError saying what to do,
    as a handler without explanations answers /explanations (500)."""
    try:
        import captum.attr
    except ImportError as exc:
        raise NotImplementedError(
            f"{owner} explains its predictions with captum, which this model's environment "
            f"cannot import ({exc}): install captum in the model's environment "
            f"(requirements.txt), or pip install captum next to the server's torch"
        ) from exc
    return captum.attr


def checked_target(target: Any, classes: int) -> int:
    """``target`` as a class index of a model that scores ``classes`` classes; anything else is
    the caller's mistake (400), not a captum traceback."""
    if isinstance(target, bool) or not isinstance(target, int):
        raise PredictionException(
            f"target must be a class index (an integer from 0 to {classes - 1}), found {target!r}",
            400,
        )
    if not 0 <= target < classes:
        raise PredictionException(
            f"target {target} is not a class of this model: it scores {classes} classes "
            f"(0 to {classes - 1})",
            400,
        )
    return target
