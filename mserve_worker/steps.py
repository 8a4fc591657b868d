"""A continuous-batching handler's requests between its calls, kept on its context: which go on
after each call (TorchServe's ``context.stopping_criteria``, one verdict per result), the
``ts_stream_next`` header that tells the server so, and the clean-up of a request's state when it
is dropped (its client left, its deadline passed, or its step failed). The service
(:mod:`.service`) keeps one :class:`Steps` per handler; the loop (:mod:`.continuous`) drives it.

Runs inside the model's own environment: standard library only, Python 3.8.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Collection, Sequence
from typing import Any

NEXT_HEADER = "ts_stream_next"


class Steps:
    """The requests a continuous-batching handler is generating, between its calls."""

    def __init__(self) -> None:
        self.running: dict[str, Any] = {}  # request id -> its stopping criterion
        # the last call's ts_stream_next values by row, for rows whose answer the handler set
        # nothing on: the service adds the header to the answer itself (see ``mark``), which
        # spares a request processor per request per step
        self.marks: dict[int, str] = {}

    def begin(self, items: Sequence[Any], cancelled: Collection[str], context: Any) -> None:
        """A step starts with ``items``: clean up what went on last step and is not here."""
        if not self.running:
            return
        here = {item.request_id for item in items if item.request_id not in cancelled}
        for request_id in [r for r in self.running if r not in here]:
            _clean_up(context, request_id, self.running.pop(request_id))

    def judge(self, context: Any, outputs: Sequence[Any]) -> None:
        """Ask the handler's stopping criteria about each result of the call just made; mark
        the requests that go on. Raises what a criterion raises (the call then fails)."""
        criteria = getattr(context, "stopping_criteria", None)
        ids = context.request_ids
        marks = self.marks
        marks.clear()
        for idx in range(len(outputs)):
            request_id = ids.get(idx)
            criterion = _criterion_of(criteria, idx)
            stop = None if criterion is None else criterion(outputs[idx])
            if stop is False:
                marks[idx] = "true"
                self.running[request_id] = criterion
            else:
                self.running.pop(request_id, None)
                if stop is True:
                    marks[idx] = "false"

    def mark(self, context: Any, everywhere: bool) -> None:
        """Set the last call's ts_stream_next headers through the context, as a handler sets a
        header, when the answers are built from request processors: ``everywhere`` (v1/v2
        answers), or the handler made them (it read or set something per request). Otherwise
        the marks stay for the service to add to the answers it builds."""
        marks = self.marks
        if not marks or not (everywhere or context._touched(0) is not None):
            return
        for idx, value in marks.items():
            context.set_response_header(idx, NEXT_HEADER, value)
        marks.clear()


def forget(context: Any, why: str) -> None:
    """Clean up every request the handler was generating (their step failed)."""
    steps = getattr(context, "_mserve_steps", None)
    if steps is not None:
        for request_id in list(steps.running):
            _clean_up(context, request_id, steps.running.pop(request_id), why)


def _criterion_of(criteria: Any, idx: int) -> Any:
    """Request ``idx``'s criterion: from a list (TorchServe's way), or one for all."""
    if criteria is None:
        return None
    if isinstance(criteria, (list, tuple)):
        return criteria[idx] if idx < len(criteria) else None
    return criteria if callable(criteria) else None


def _clean_up(
    context: Any, request_id: str, criterion: Any,
    why: str = "was dropped by the server (client gone or deadline passed)",
) -> None:  # fmt: skip
    print(f"request {request_id} {why}; cleaning up its state", file=sys.stderr)
    try:
        clean_up = getattr(criterion, "clean_up", None)
        if callable(clean_up):
            clean_up()
            return
        cache = getattr(context, "cache", None)
        if isinstance(cache, dict):
            cache.pop(request_id, None)
    except Exception:  # the handler's own clean-up failing must not fail the next step
        traceback.print_exc()
