"""The request's trace context inside the worker (docs/observability.md).

The server passes each request's W3C ``traceparent`` as a request header (appended last while
the server traces). Here: whether a batch is traced, the handler phases' times the server makes
spans of, and, when the model's environment has ``opentelemetry``, the handler call running
inside the request's context, so the handler's own spans join the request's trace. Standard
library only; opentelemetry is looked for once, at the first traced batch, never imported
otherwise.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable, Sequence, Tuple

# (phase, perf_counter at its start, at its end), as BaseHandler.handle records them
Phase = Tuple[str, float, float]


def traced_by_server(items: Sequence[Any]) -> bool:
    """Whether the server traces this batch: it appends ``traceparent`` last to the first
    request's headers (one look, no scan)."""
    if not items:
        return False
    first = items[0]
    last_header_is = getattr(first, "last_header_is", None)
    if last_header_is is not None:  # a RequestItem: its packed headers stay packed
        return bool(last_header_is("traceparent"))
    headers = first.headers
    return type(headers) is list and bool(headers) and headers[-1][0] == "traceparent"


def header(item: Any, name: str) -> str | None:
    may_have = getattr(item, "may_have_header", None)
    if may_have is not None and not may_have(name):  # most requests carry no trace context
        return None
    for key, value in item.headers:
        if key.lower() == name:
            return value  # type: ignore[no-any-return]
    return None


def phase_offsets(phases: list[Phase], started: float) -> list[list[Any]]:
    """The phases as ``[name, start_ms, duration_ms]`` from ``started`` (the handler call's
    start, from which the worker's ``handler_ms`` counts), for the RESULT frame."""
    return [
        [name, round((t0 - started) * 1000, 3), round((t1 - t0) * 1000, 3)]
        for name, t0, t1 in phases
    ]


class Bridge:
    """OpenTelemetry in the model's environment, when it is there."""

    def __init__(self) -> None:
        self._api: tuple[Any, Any] | None = None
        self._looked = False

    def available(self) -> bool:
        if not self._looked:
            self._looked = True
            try:
                if importlib.util.find_spec("opentelemetry.context") is not None:
                    context = importlib.import_module("opentelemetry.context")
                    propagate = importlib.import_module(
                        "opentelemetry.trace.propagation.tracecontext"
                    )
                    self._api = (context, propagate.TraceContextTextMapPropagator())
            except Exception:  # a broken install must not fail the batch: no bridge then
                self._api = None
        return self._api is not None

    def enter(self, item: Any) -> Callable[[], None] | None:
        """Make ``item``'s trace context the current one; returns what restores the previous
        one (None when the request has none or opentelemetry is missing)."""
        if not self.available():
            return None
        parent = header(item, "traceparent")
        if parent is None:
            return None
        assert self._api is not None
        context, propagator = self._api
        carrier = {"traceparent": parent}
        state = header(item, "tracestate")
        if state is not None:
            carrier["tracestate"] = state
        token = context.attach(propagator.extract(carrier))
        return lambda: context.detach(token)  # type: ignore[no-any-return]
