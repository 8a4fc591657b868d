"""The span exporter's own OTLP encoding and OTLP/HTTP sender (server/tracing/otlp.py and
senders.py): its bytes are those the SDK's encoder makes of the same spans, and it posts them over
one kept-alive connection with the standard variables' headers, compression and timeout, to a
real HTTP server in this test."""

from __future__ import annotations

import gzip
import http.server
import socket
import threading
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from server.tracing import otlp, senders
from server.tracing.export import Spans
from server.tracing.settings import ExportOptions, export_options

TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
START = 1_700_000_000_123_456_789

# (span id, parent id, remote parent, name, kind, attributes, events, status, tracestate)
SPANS = [
    (5, 7, True, "POST /predictions/{model}", SpanKind.SERVER,
     {"mserve.model": "echo", "mserve.batch_size": 1, "http.response.status_code": 503,
      "neg": -3, "zero": 0, "empty": "", "yes": True, "no": False, "ratio": 0.25,
      "big": 2**62, "list": [1, 2], "names": ("a", "b"), "text": "h\u00e9llo \u2603" * 40},
     [("exception", START + 9, {"exception.message": "boom"})],
     Status(StatusCode.ERROR, "boom"), "vendor=a,other=b"),
    (6, 5, False, "mserve.queue", SpanKind.INTERNAL, {}, [], Status(StatusCode.UNSET),
     "vendor=a,other=b"),
    (8, 0, False, "mserve.model.load", SpanKind.INTERNAL, {"mserve.model": "echo"}, [],
     Status(StatusCode.ERROR), None),
    # values protobuf cannot take are left out, as the SDK's encoder leaves them out
    (9, 8, False, "odd", SpanKind.INTERNAL, {"huge": 2**64, "obj": object(), "ok": 1}, [],
     Status(StatusCode.UNSET), None),
    (2**64 - 1, 1, False, "x" * 300, SpanKind.INTERNAL, None, [], Status(StatusCode.OK), None),
]  # fmt: skip


def _sdk(resource: Resource, span: tuple[Any, ...]) -> ReadableSpan:
    span_id, parent_id, remote, name, kind, attributes, events, status, tracestate = span
    state = TraceState.from_header([tracestate]) if tracestate else None
    sampled = TraceFlags(TraceFlags.SAMPLED)
    own = SpanContext(TRACE, span_id, False, sampled, state)
    parent = SpanContext(TRACE, parent_id, remote, sampled, state) if parent_id else None
    return ReadableSpan(
        name, own, parent, resource, attributes, tuple(Event(n, a, t) for n, t, a in events),
        kind=kind, status=status, start_time=START, end_time=START + 10,
        instrumentation_scope=InstrumentationScope("mserve"),
    )  # fmt: skip


def test_spans_encode_to_the_sdk_encoders_bytes() -> None:
    resource = Resource.create({"service.name": "mserve", "service.version": "1.2.3"})
    expected = encode_spans([_sdk(resource, span) for span in SPANS]).SerializeToString()
    encoder = otlp.Encoder()
    kinds = {SpanKind.SERVER: otlp.KIND_SERVER, SpanKind.INTERNAL: otlp.KIND_INTERNAL}
    batch = otlp.Batch(dict(resource.attributes), "mserve")
    for _ in range(2):  # the second time from the cache of encoded attributes
        encoded = [
            encoder.span(
                TRACE.to_bytes(16, "big"), span_id, tracestate or "", parent_id, remote,
                name, kinds[kind], START, START + 10, attributes, events,
                status.status_code.value, status.description or "",
            )
            for span_id, parent_id, remote, name, kind, attributes, events, status, tracestate
            in SPANS
        ]  # fmt: skip
        assert batch.request(encoded) == expected


def test_a_requests_record_becomes_its_spans() -> None:
    """A record as the frontend sends it decodes to the server span and its children."""
    us = 1000  # ns
    children = (START, START + us, START + 2 * us, START + 9 * us, "3", 2, 0.005,  # 5 us
                [["preprocess", 0, 0.001], ["bogus", 0, 1], ["inference", 0.001, 0.003]],
                (START + 9 * us, 4))  # fmt: skip
    record = ("q", "POST /predictions/{model}", f"{TRACE:032x}", 5, 7, "k=v,bad", START,
              START + 10 * us, 200, None, {"mserve.model": "echo"}, children)  # fmt: skip
    encoded: list[bytes] = []
    Spans().of(record, encoded)
    request = ExportTraceServiceRequest()
    request.ParseFromString(otlp.Batch({"service.name": "mserve"}, "mserve").request(encoded))
    (resource,) = request.resource_spans
    (scope,) = resource.scope_spans
    assert scope.scope.name == "mserve"
    spans = {span.name: span for span in scope.spans}
    assert list(spans) == ["mserve.queue", "mserve.batch", "mserve.worker", "mserve.handler",
                           "mserve.preprocess", "mserve.inference", "mserve.stream",
                           "POST /predictions/{model}"]  # fmt: skip
    root = spans["POST /predictions/{model}"]
    assert root.parent_span_id == (7).to_bytes(8, "big") and root.kind == root.SPAN_KIND_SERVER
    assert root.flags == 0x300  # its parent is the client's, remote
    assert {a.key: a.value.int_value for a in root.attributes if a.value.HasField("int_value")} \
        == {"mserve.batch_size": 2, "http.response.status_code": 200}  # fmt: skip
    assert root.trace_state == ""  # an invalid tracestate is dropped, as the SDK does
    assert spans["mserve.handler"].parent_span_id == spans["mserve.worker"].span_id
    assert spans["mserve.inference"].parent_span_id == spans["mserve.handler"].span_id
    # the handler ends at the answer, its phases from its start (the worker's offsets)
    assert spans["mserve.handler"].start_time_unix_nano == START + 4 * us
    assert spans["mserve.inference"].start_time_unix_nano == START + 5 * us
    assert spans["mserve.inference"].end_time_unix_nano == START + 8 * us
    assert spans["mserve.stream"].attributes[0].value.int_value == 4


class _Collector:
    """An OTLP/HTTP endpoint recording each post's headers, body and client port; answers
    ``status``; closes the connection after each answer saying so (``close``) or not
    (``drop``)."""

    def __init__(self) -> None:
        self.posts: list[tuple[dict[str, str], bytes, int]] = []
        self.status, self.close, self.drop = 200, False, False
        self.statuses: list[int] = []  # answered first, one a post
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                collector.posts.append((dict(self.headers), body, self.client_address[1]))
                close = collector.close or collector.drop  # before the client has its answer
                status = collector.statuses.pop(0) if collector.statuses else collector.status
                self.send_response(status)
                self.send_header("Content-Length", "0")
                if collector.close:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = close

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def collector() -> Any:
    collector = _Collector()
    yield collector
    collector.server.shutdown()


def test_http_exports_share_one_connection_with_the_standard_options(collector) -> None:
    environ = {"OTEL_EXPORTER_OTLP_HEADERS": "api-key=s%3Dcret,x-team=a",
               "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip"}  # fmt: skip
    sender = senders.HttpSender(collector.url, export_options(environ))
    for body in (b"one", b"two", b"three"):
        assert sender.send(body) is None
    assert [gzip.decompress(body) for _, body, _ in collector.posts] == [b"one", b"two", b"three"]
    assert len({port for _, _, port in collector.posts}) == 1  # kept alive
    headers = {k.lower(): v for k, v in collector.posts[0][0].items()}
    assert headers["content-type"] == "application/x-protobuf"
    assert headers["content-encoding"] == "gzip"
    assert headers["api-key"] == "s=cret" and headers["x-team"] == "a"
    collector.close = True  # the collector says it closes: the next post opens another
    assert sender.send(b"four") is None and sender.send(b"five") is None
    ports = [port for _, _, port in collector.posts]
    assert ports[3] == ports[0] != ports[4]
    collector.close, collector.drop = False, True  # it closes without a word (idle timeout)
    assert sender.send(b"six") is None and sender.send(b"seven") is None
    assert [gzip.decompress(body) for _, body, _ in collector.posts[-2:]] == [b"six", b"seven"]
    collector.drop, collector.statuses = False, [503]  # busy: tried again after ~1 s
    assert sender.send(b"eight") is None
    assert [gzip.decompress(body) for _, body, _ in collector.posts[-2:]] == [b"eight"] * 2
    collector.status, posts = 400, len(collector.posts)  # refused: not tried again
    assert sender.send(b"nine") == "Failed to export spans batch code: 400, reason: Bad Request"
    assert len(collector.posts) == posts + 1
    sender.close()


def test_an_unreachable_collector_is_retried_within_the_timeout() -> None:
    options = export_options({"OTEL_EXPORTER_OTLP_TIMEOUT": "0.5"})
    with socket.socket() as bound:  # bound, not listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}/v1/traces"
        failure = senders.HttpSender(url, options).send(b"spans")
    assert failure is not None
    assert failure.startswith("Failed to export spans batch: [Errno 111] Connection refused")


def test_every_otlp_variable_the_traces_one_first() -> None:
    """Each ``OTEL_EXPORTER_OTLP_TRACES_<X>`` wins over ``OTEL_EXPORTER_OTLP_<X>`` (the
    OpenTelemetry specification); an empty one counts as unset; headers are percent-decoded."""
    generic = {"HEADERS": "a=1", "TIMEOUT": "3", "COMPRESSION": "deflate",
               "CERTIFICATE": "/generic.pem", "INSECURE": "false",
               "CLIENT_CERTIFICATE": "/generic.crt", "CLIENT_KEY": "/generic.key"}  # fmt: skip
    traces = {"HEADERS": "b=2%2C3", "TIMEOUT": "4", "COMPRESSION": "gzip",
              "CERTIFICATE": "/traces.pem", "INSECURE": "true",
              "CLIENT_CERTIFICATE": "/traces.crt", "CLIENT_KEY": "/traces.key"}  # fmt: skip
    environ = {f"OTEL_EXPORTER_OTLP_{k}": v for k, v in generic.items()}
    as_generic = ExportOptions({"a": "1"}, 3.0, "deflate", "/generic.pem", False,
                               "/generic.crt", "/generic.key")  # fmt: skip
    assert export_options(environ) == as_generic
    environ |= {f"OTEL_EXPORTER_OTLP_TRACES_{k}": v for k, v in traces.items()}
    assert export_options(environ) == ExportOptions(
        {"b": "2,3"}, 4.0, "gzip", "/traces.pem", True, "/traces.crt", "/traces.key"
    )
    environ |= {f"OTEL_EXPORTER_OTLP_TRACES_{k}": "" for k in traces}
    assert export_options(environ) == as_generic
    assert export_options({}) == ExportOptions({}, 10.0, "none", None, None, None, None)
