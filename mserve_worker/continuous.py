"""Continuous batching, worker side: which requests of a step go on, and cleaning up after the
ones the server dropped.

The server calls the handler step after step (server/models/continuous.py). After each call
the handler's ``context.stopping_criteria`` (TorchServe's: one callable per request, given that
request's result) says, per request: ``False`` it goes on (its result is one chunk of its
stream), ``True`` this was its last chunk, ``None`` its result is its whole answer. A request
that goes on gets TorchServe's ``ts_stream_next: true`` response header, which the server reads.

A request that went on and is missing from the next step was dropped by the server: its client
went away or its deadline passed. Its state is then cleaned up as a TorchServe handler does when
it finishes: its stopping criterion's ``clean_up()`` when it has one (TorchServe's vLLM
handler), else its ``context.cache`` entry (keyed by request id) is removed.

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
        for idx in range(len(outputs)):
            request_id = ids.get(idx)
            criterion = _criterion(criteria, idx)
            stop = None if criterion is None else criterion(outputs[idx])
            if stop is False:
                context.set_response_header(idx, NEXT_HEADER, "true")
                self.running[request_id] = criterion
            else:
                self.running.pop(request_id, None)
                if stop is True:
                    context.set_response_header(idx, NEXT_HEADER, "false")


def _criterion(criteria: Any, idx: int) -> Any:
    """Request ``idx``'s criterion: from a list (TorchServe's way), or one for all."""
    if criteria is None:
        return None
    if isinstance(criteria, (list, tuple)):
        return criteria[idx] if idx < len(criteria) else None
    return criteria if callable(criteria) else None


def _clean_up(context: Any, request_id: str, criterion: Any) -> None:
    print(
        f"request {request_id} was dropped by the server (client gone or deadline passed);"
        " cleaning up its state",
        file=sys.stderr,
    )
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
