"""The span exporter process (``python -m server.tracing.export SETTINGS``), started and fed by
server/tracing/process.py: the frontend hands it compact records (ids, times, attributes) so
that making the spans, encoding them and sending them cost the frontend's event loop nothing.
Spans go straight from records to OTLP's protobuf bytes (server/tracing/otlp.py: no SDK span
or message objects), many requests' in one export, the resource and scope written once.

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
import marshal
import os
import select
import struct
import sys
from random import getrandbits
from typing import Any

from server.tracing import otlp, senders
from server.tracing.settings import export_options

FRAME = struct.Struct(">I")
MAX_BATCH_RECORDS = 512  # read before an export: ~4000 spans, one OTLP request
_PHASES = {p: f"mserve.{p}" for p in ("preprocess", "inference", "postprocess")}


class Spans:
    """Records to encoded OTLP spans (server/tracing/otlp.py), the spans the SDK would have made
    of them in the frontend."""

    def __init__(self) -> None:
        self._encoder = otlp.Encoder()
        self._states: dict[str, str] = {}

    def of(self, record: tuple[Any, ...], out: list[bytes]) -> None:
        """Append the record's spans to ``out``."""
        if record[0] == "q":
            self.request(record, out)
        elif record[0] == "s":
            out.append(self.work(record))

    def work(self, record: tuple[Any, ...]) -> bytes:
        _, name, trace_hex, span_id, parent_id, start, end, attributes, error = record
        status, message, events = otlp.STATUS_UNSET, "", ()
        if error is not None:
            kind, text = error
            status, message = otlp.STATUS_ERROR, f"{kind}: {text}"
            events = (("exception", end, {"exception.type": kind, "exception.message": text}),)
        return self._encoder.span(
            bytes.fromhex(trace_hex), span_id, "", parent_id, False, name,
            otlp.KIND_INTERNAL, start, end, attributes, events, status, message,
        )  # fmt: skip

    def _state(self, header: str) -> str:
        """A tracestate header as the SDK keeps it (invalid: none; re-joined), cached."""
        state = self._states.get(header)
        if state is None:
            from opentelemetry.trace.span import TraceState

            if len(self._states) >= 1024:
                self._states.clear()
            parsed = TraceState.from_header([header])
            state = self._states[header] = ",".join(f"{k}={v}" for k, v in parsed.items())
        return state

    def request(self, record: tuple[Any, ...], out: list[bytes]) -> None:
        """The request's server span and its children."""
        (_, name, trace_hex, span_id, parent_id, tracestate, start, end, code, error,
         attributes, children) = record  # fmt: skip
        trace_id = bytes.fromhex(trace_hex)
        state = self._state(tracestate) if tracestate else ""
        enqueued, popped, sent, answered, worker, size, handler_ms, phases, stream = children
        encode, internal = self._encoder.span, otlp.KIND_INTERNAL

        def child(name: str, parent: int, begin: int, finish: int, attributes: Any = None) -> int:
            own = getrandbits(64) or 1
            out.append(encode(trace_id, own, state, parent, False, name, internal, begin,
                              finish, attributes, (), otlp.STATUS_UNSET, ""))  # fmt: skip
            return own

        if enqueued is not None and not sent:  # never reached a worker
            child("mserve.queue", span_id, enqueued, answered)
        elif enqueued is not None:
            child("mserve.queue", span_id, enqueued, popped)
            child("mserve.batch", span_id, popped, sent, {"mserve.batch_size": size})
            attributes["mserve.worker_id"] = worker
            attributes["mserve.batch_size"] = size
            call = child("mserve.worker", span_id, sent, answered,
                         {"mserve.worker_id": worker, "mserve.batch_size": size})  # fmt: skip
            if type(handler_ms) in (int, float) and handler_ms >= 0:
                begin = max(sent, answered - int(handler_ms * 1e6))
                handler = child("mserve.handler", call, begin, answered)
                for phase in phases if type(phases) is list else ():
                    if (
                        type(phase) is list and len(phase) == 3 and phase[0] in _PHASES
                        and all(type(x) in (int, float) and x >= 0 for x in phase[1:])
                    ):  # fmt: skip
                        first = begin + int(phase[1] * 1e6)
                        last = min(answered, first + int(phase[2] * 1e6))
                        child(_PHASES[phase[0]], handler, first, last)
        if stream is not None:
            child("mserve.stream", span_id, stream[0], end, {"mserve.chunks": stream[1]})
        attributes["http.response.status_code"] = code
        status, message, events = otlp.STATUS_UNSET, "", ()
        if error is not None or code >= 500:
            status, message = otlp.STATUS_ERROR, error or ""
            if error is not None:
                events = (("exception", end, {"exception.message": error}),)
        out.append(encode(
            trace_id, span_id, state, parent_id, bool(parent_id), name, otlp.KIND_SERVER,
            start, end, attributes, events, status, message,
        ))  # fmt: skip


def _resource() -> dict[str, Any]:
    """The SDK's resource (its detectors, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME``),
    made once: only its attributes are sent."""
    from opentelemetry.sdk.resources import Resource

    from archiver import __version__

    if os.environ.get("OTEL_SERVICE_NAME"):  # Resource.create read it; ours must not win
        return dict(Resource.create({"service.version": __version__}).attributes)
    return dict(
        Resource.create({"service.name": "mserve", "service.version": __version__}).attributes
    )


def sender(settings: dict[str, Any]) -> senders.HttpSender | senders.GrpcSender:
    """The sender for the configured protocol, with the standard variables' options (read
    here, from the environment this process has from the server, so that no header is on its
    command line)."""
    options = export_options(os.environ)
    if settings["protocol"] == "grpc":
        return senders.GrpcSender(settings["endpoint"], options)
    return senders.HttpSender(settings["endpoint"], options)


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
    send = sender(settings)
    batch = otlp.Batch(_resource(), "mserve")
    spans = Spans()
    source, out = sys.stdin.fileno(), sys.stdout.fileno()
    buffer = bytearray()
    failing = False
    ended = False
    while not ended:
        records, ended = _read_records(source, buffer, MAX_BATCH_RECORDS)
        encoded: list[bytes] = []
        for record in records:
            spans.of(record, encoded)
        if not encoded:
            continue
        failure = send.send(batch.request(encoded))
        if failure is None:
            if failing:
                failing = False
                _report(out, ("recovered", 0, ""))
        else:
            failing = True
            _report(out, ("failed", len(encoded), failure))
    send.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
