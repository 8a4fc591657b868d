"""The span exporter process (``python -m server.tracing_export SETTINGS``), started and fed by
server/tracing_process.py: the frontend hands it compact records (ids, times, attributes) so
that making the spans, encoding them (OTLP protobuf, ~20 us a span) and sending them cost the
frontend's event loop nothing.

Input, on stdin: frames of a 4-byte big-endian length then ``marshal.dumps`` of a list of
records, each a tuple:

- ``("q", name, trace_id, span_id, parent_id, tracestate, start, end, status, error,
  attributes, children)``: a request's server span; ``children`` None or (enqueued, popped,
  sent, answered, worker id, batch size, handler_ms, phases, stream) from which its children
  (queue wait, batch assembly, the worker's round trip, the handler call and its phases,
  streaming) are made;
- ``("s", name, trace_id, span_id, parent_id, start, end, attributes, error)``: a span of server
  work (a model load, an environment build); ``error`` None or (exception type, message).

Times are the epoch's nanoseconds, ``trace_id`` 32 hex digits, span ids ints. Output, on stdout
in the same framing: one report per failed export, ``("failed", spans, message)``, and
``("recovered", 0, "")`` at the first export that succeeds after failures; the frontend logs
and counts them. At the end of stdin it exports what it holds and exits.
"""

from __future__ import annotations

import json
import logging
import marshal
import os
import select
import struct
import sys
from collections.abc import Iterator
from random import getrandbits
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

FRAME = struct.Struct(">I")
MAX_BATCH_RECORDS = 512  # read before an export: ~4000 spans, one OTLP request
_PHASES = ("preprocess", "inference", "postprocess")


class Spans:
    """Records to the SDK's ReadableSpans, as the SDK would have made them in the frontend."""

    def __init__(self, resource: Resource, scope: InstrumentationScope) -> None:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
        from opentelemetry.trace.span import TraceState

        self.resource, self.scope = resource, scope
        self._readable, self._event, self._context = ReadableSpan, Event, SpanContext
        self._kind, self._status, self._code = SpanKind, Status, StatusCode
        self._sampled, self._state = TraceFlags(TraceFlags.SAMPLED), TraceState

    def of(self, record: tuple[Any, ...]) -> Iterator[ReadableSpan]:
        if record[0] == "q":
            yield from self.request(record)
        elif record[0] == "s":
            yield self.work(record)

    def work(self, record: tuple[Any, ...]) -> ReadableSpan:
        _, name, trace_hex, span_id, parent_id, start, end, attributes, error = record
        trace_id = int(trace_hex, 16)
        own = self._context(trace_id, span_id, False, self._sampled)
        parent = self._context(trace_id, parent_id, False, self._sampled) if parent_id else None
        status, events = self._status(self._code.UNSET), ()
        if error is not None:
            kind, message = error
            status = self._status(self._code.ERROR, f"{kind}: {message}")
            attrs = {"exception.type": kind, "exception.message": message}
            events = (self._event("exception", attrs, end),)
        return self._readable(
            name, own, parent, self.resource, attributes, events, status=status,
            start_time=start, end_time=end, instrumentation_scope=self.scope,
        )  # fmt: skip

    def request(self, record: tuple[Any, ...]) -> Iterator[ReadableSpan]:
        """The request's server span and its children."""
        (_, name, trace_hex, span_id, parent_id, tracestate, start, end, code, error,
         attributes, children) = record  # fmt: skip
        trace_id = int(trace_hex, 16)
        state = self._state.from_header([tracestate]) if tracestate else None
        sampled = self._sampled
        own = self._context(trace_id, span_id, False, sampled, state)
        enqueued, popped, sent, answered, worker, size, handler_ms, phases, stream = children

        def child(name: str, parent: Any, begin: int, finish: int, **attrs: Any) -> ReadableSpan:
            context = self._context(trace_id, getrandbits(64) or 1, False, sampled, state)
            return self._readable(
                name, context, parent, self.resource, attrs, start_time=begin,
                end_time=finish, instrumentation_scope=self.scope,
            )  # fmt: skip

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
            if type(handler_ms) in (int, float) and handler_ms >= 0:
                begin = max(sent, answered - int(handler_ms * 1e6))
                handler = child("mserve.handler", call.context, begin, answered)
                yield handler
                for phase in phases if type(phases) is list else ():
                    if (
                        type(phase) is list and len(phase) == 3 and phase[0] in _PHASES
                        and all(type(x) in (int, float) and x >= 0 for x in phase[1:])
                    ):  # fmt: skip
                        first = begin + int(phase[1] * 1e6)
                        last = min(answered, first + int(phase[2] * 1e6))
                        yield child(f"mserve.{phase[0]}", handler.context, first, last)
        if stream is not None:
            yield child("mserve.stream", own, stream[0], end, **{"mserve.chunks": stream[1]})
        attributes["http.response.status_code"] = code
        status, events = self._status(self._code.UNSET), ()
        if error is not None or code >= 500:
            status = self._status(self._code.ERROR, error)
            if error is not None:
                events = (self._event("exception", {"exception.message": error}, end),)
        parent = None
        if parent_id:  # the client's span, remote
            parent = self._context(trace_id, parent_id, True, sampled, state)
        yield self._readable(
            name, own, parent, self.resource, attributes, events, kind=self._kind.SERVER,
            status=status, start_time=start, end_time=end, instrumentation_scope=self.scope,
        )  # fmt: skip


class _LastMessage(logging.Handler):
    """Keeps the exporter's last warning (why an export failed) for the failure report, instead
    of printing one per retry."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.message = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage()


def _exporter(settings: dict[str, Any]) -> Any:
    if settings["protocol"] == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    return OTLPSpanExporter(endpoint=settings["endpoint"], headers=settings["headers"] or None)


def _resource() -> Resource:
    from opentelemetry.sdk.resources import Resource

    from archiver import __version__

    if os.environ.get("OTEL_SERVICE_NAME"):  # Resource.create read it; ours must not win
        return Resource.create({"service.version": __version__})
    return Resource.create({"service.name": "mserve", "service.version": __version__})


def _read_records(fd: int, buffer: bytearray, limit: int) -> tuple[list[Any], bool]:
    """Records from ``fd``: blocks for the first frame, then takes what else is already there,
    up to ``limit`` records; (records, whether stdin ended)."""
    records: list[Any] = []
    wait = True
    while len(records) < limit:
        while len(buffer) >= FRAME.size:
            (size,) = FRAME.unpack_from(buffer)
            if len(buffer) < FRAME.size + size:
                break
            records.extend(marshal.loads(bytes(buffer[FRAME.size : FRAME.size + size])))
            del buffer[: FRAME.size + size]
        if records:
            wait = False
        if not wait and not select.select([fd], [], [], 0)[0]:
            break
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return records, True
        buffer += chunk
    return records, False


def _report(out: int, message: tuple[Any, ...]) -> None:
    data = marshal.dumps(message, 4)
    os.write(out, FRAME.pack(len(data)) + data)


def main(argv: list[str]) -> int:
    settings = json.loads(argv[1])
    last = _LastMessage()
    otel = logging.getLogger("opentelemetry")
    otel.addHandler(last)
    otel.propagate = False
    from opentelemetry.sdk.trace.export import SpanExportResult
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    exporter = _exporter(settings)
    spans = Spans(_resource(), InstrumentationScope("mserve"))
    source, out = sys.stdin.fileno(), sys.stdout.fileno()
    buffer = bytearray()
    failing = False
    ended = False
    while not ended:
        records, ended = _read_records(source, buffer, MAX_BATCH_RECORDS)
        batch = [span for record in records for span in spans.of(record)]
        if not batch:
            continue
        last.message = ""
        if exporter.export(batch) is SpanExportResult.SUCCESS:
            if failing:
                failing = False
                _report(out, ("recovered", 0, ""))
        else:
            failing = True
            _report(out, ("failed", len(batch), last.message or "the exporter gave no reason"))
    exporter.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
