"""The request spans of server/tracing.py made on the export thread: a sampled request reaches
the SDK's batch span processor as one :class:`~server.tracing.RequestTrace` (ids and times),
and :class:`Expand`, wrapping the OTLP exporter, turns it into the server span and its children
there, off the request path. Spans made through the SDK (model loads, environment builds) pass
through as they are."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from random import getrandbits
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from server.tracing import RequestTrace

_PHASES = ("preprocess", "inference", "postprocess")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class Expand(SpanExporter):
    """An exporter that makes the spans of the requests it is handed, then exports them all
    with ``exporter``."""

    def __init__(
        self, exporter: SpanExporter, resource: Resource, scope: InstrumentationScope
    ) -> None:
        self.exporter = exporter
        self.resource = resource
        self.scope = scope

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        out: list[ReadableSpan] = []
        for span in spans:
            if isinstance(span, ReadableSpan):
                out.append(span)
            else:
                out.extend(self.spans(span))
        return self.exporter.export(out)

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)

    def spans(self, trace: RequestTrace) -> Iterator[ReadableSpan]:
        """The request's server span and its children (queue wait, batch assembly, the
        worker's round trip, the handler call and its phases, streaming)."""
        trace_id = int(trace.trace_id, 16)
        state = TraceState.from_header([trace.tracestate]) if trace.tracestate else None
        own = SpanContext(trace_id, trace.span_id, False, _SAMPLED, state)
        enqueued, popped, sent, answered, worker, size, meta, stream = trace.children

        def child(
            name: str, parent: SpanContext, start: int, end: int, **attributes: Any
        ) -> ReadableSpan:
            context = SpanContext(trace_id, getrandbits(64) or 1, False, _SAMPLED, state)
            return ReadableSpan(
                name, context, parent, self.resource, attributes, start_time=start,
                end_time=end, instrumentation_scope=self.scope,
            )  # fmt: skip

        attributes = dict(trace.attributes)
        if enqueued is not None and not sent:  # never reached a worker
            yield child("mserve.queue", own, enqueued, answered)
        elif enqueued is not None:
            yield child("mserve.queue", own, enqueued, popped)
            yield child("mserve.batch", own, popped, sent, **{"mserve.batch_size": size})
            attributes["mserve.worker_id"] = worker
            attributes["mserve.batch_size"] = size
            call = child("mserve.worker", own, sent, answered,
                         **{"mserve.worker_id": worker, "mserve.batch_size": size})  # fmt: skip
            yield call
            handler_ms = meta.get("handler_ms")
            if type(handler_ms) in (int, float) and handler_ms >= 0:
                start = max(sent, answered - int(handler_ms * 1e6))
                handler = child("mserve.handler", call.context, start, answered)
                yield handler
                phases = meta.get("phases")
                for phase in phases if type(phases) is list else ():
                    if (
                        type(phase) is list and len(phase) == 3 and phase[0] in _PHASES
                        and all(type(x) in (int, float) and x >= 0 for x in phase[1:])
                    ):  # fmt: skip
                        begin = start + int(phase[1] * 1e6)
                        end = min(answered, begin + int(phase[2] * 1e6))
                        yield child(f"mserve.{phase[0]}", handler.context, begin, end)
        if stream is not None:
            yield child("mserve.stream", own, stream[0], trace.end, **{"mserve.chunks": stream[1]})
        attributes["http.response.status_code"] = trace.status
        status, events = Status(StatusCode.UNSET), ()
        if trace.error is not None or trace.status >= 500:
            status = Status(StatusCode.ERROR, trace.error)
            if trace.error is not None:
                events = (Event("exception", {"exception.message": trace.error}, trace.end),)
        parent = None
        if trace.parent_id:  # the client's span, remote
            parent = SpanContext(trace_id, trace.parent_id, True, _SAMPLED, state)
        yield ReadableSpan(
            trace.name, own, parent, self.resource, attributes, events, kind=SpanKind.SERVER,
            status=status, start_time=trace.start, end_time=trace.end,
            instrumentation_scope=self.scope,
        )  # fmt: skip
