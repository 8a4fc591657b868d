"""OpenTelemetry traces end to end: a real server exporting over OTLP/HTTP to a real receiver in
this test (an HTTP server decoding ``ExportTraceServiceRequest`` with opentelemetry-proto), real
workers running tests/handlers/trace_echo (a BaseHandler subclass echoing its trace context)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from server.config import load_config
from server.errors import ConfigError
from server.rpc.protos import inference_pb2 as ipb
from server.rpc.protos import inference_pb2_grpc
from server.tracing import trace_settings
from tests.server.conftest import Server, wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


class Receiver:
    """An OTLP/HTTP traces endpoint: every span it is sent, with its attributes, by span id."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(request)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    attrs = {a.key: _value(a.value) for a in span.attributes}
                    with self.lock:
                        self.spans.append({
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "attrs": attrs,
                            "status": span.status.code,
                            "start": span.start_time_unix_nano,
                            "end": span.end_time_unix_nano,
                        })  # fmt: skip

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait_trace(self, trace_id: str, names: set[str]) -> dict[str, dict[str, Any]]:
        """The trace's spans by name, once all of ``names`` came (the exporter batches)."""
        wait_until(lambda: names <= {s["name"] for s in self.trace(trace_id)}, 20,
                   f"spans {sorted(names)} of trace {trace_id}")  # fmt: skip
        return {s["name"]: s for s in self.trace(trace_id)}


def _header(reply: Any, name: str) -> str | None:
    return next((v for k, v in reply.headers.items() if k.lower() == name), None)


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


@pytest.fixture
def traced(make_archive, start_server) -> Iterator[tuple[Server, Receiver]]:
    receiver = Receiver()
    make_archive("trace_echo", "trace_echo:TraceEcho", "echo")
    server = start_server(
        "echo=echo.mar", config={"otel_endpoint": receiver.url, "log_format": "json"}
    )
    yield server, receiver
    receiver.server.shutdown()


def test_rest_grpc_and_streamed_requests_are_traced_under_the_clients_span(traced) -> None:
    server, receiver = traced
    # REST, with the client's traceparent and request id
    reply = server.predict("echo", {"x": 1}, headers={"traceparent": TRACEPARENT,
                                                      "X-Request-ID": "client-id-1"})  # fmt: skip
    assert reply.status == 200, reply.body
    assert _header(reply, "x-request-id") == "client-id-1"
    seen = reply.json()
    # the handler sees the request's trace (its parent now the server's span) and our id
    assert seen["request_id"] == "client-id-1"
    assert seen["traceparent"].split("-")[1] == TRACE_ID
    assert seen["traceparent"] == seen["trace_context"]["traceparent"]
    server_span_id = seen["traceparent"].split("-")[2]
    assert server_span_id != CLIENT_SPAN
    # opentelemetry is importable in the worker: the handler runs inside the request's context
    assert seen["current_trace_id"] == TRACE_ID

    names = {"POST /predictions", "mserve.queue", "mserve.batch", "mserve.worker",
             "mserve.handler", "mserve.preprocess", "mserve.inference", "mserve.postprocess"}  # fmt: skip
    spans = receiver.wait_trace(TRACE_ID, names)
    root = spans["POST /predictions"]
    assert root["parent"] == CLIENT_SPAN and root["span_id"] == server_span_id
    assert root["attrs"]["mserve.model"] == "echo"
    assert root["attrs"]["mserve.model_version"] == "1.0"
    assert root["attrs"]["mserve.request_id"] == "client-id-1"
    assert root["attrs"]["mserve.batch_size"] == 1
    assert root["attrs"]["http.response.status_code"] == 200
    assert root["attrs"]["mserve.worker_id"].isdigit()
    for child in ("mserve.queue", "mserve.batch", "mserve.worker"):
        assert spans[child]["parent"] == root["span_id"], child
        assert root["start"] <= spans[child]["start"] <= spans[child]["end"] <= root["end"]
    assert spans["mserve.handler"]["parent"] == spans["mserve.worker"]["span_id"]
    for phase in ("mserve.preprocess", "mserve.inference", "mserve.postprocess"):
        assert spans[phase]["parent"] == spans["mserve.handler"]["span_id"], phase

    # no traceparent: a new trace, whose id the handler sees; a failing handler marks it
    reply = server.predict("echo", {"fail": True})
    assert reply.status >= 500
    new_trace = _header(reply, "x-request-id")
    assert new_trace
    failed = [s for s in receiver.spans if s["name"] == "POST /predictions"
              and s["attrs"].get("mserve.request_id") == new_trace]  # fmt: skip
    wait_until(lambda: any(s["attrs"].get("mserve.request_id") == new_trace
                           for s in receiver.spans if s["name"] == "POST /predictions"),
               20, "the failed request's span")  # fmt: skip
    failed = next(s for s in receiver.spans if s["name"] == "POST /predictions"
                  and s["attrs"].get("mserve.request_id") == new_trace)  # fmt: skip
    assert failed["status"] == 2  # STATUS_CODE_ERROR
    assert failed["parent"] == ""  # a root span
    assert failed["attrs"]["http.response.status_code"] >= 500

    # streamed over REST: a stream span under the server span
    stream_trace = "5" * 32
    reply = server.predict("echo", {"stream": 3},
                           headers={"traceparent": f"00-{stream_trace}-{CLIENT_SPAN}-01"})  # fmt: skip
    assert reply.body == b"chunk0;chunk1;chunk2;"
    spans = receiver.wait_trace(stream_trace, {"POST /predictions", "mserve.stream"})
    assert spans["mserve.stream"]["parent"] == spans["POST /predictions"]["span_id"]
    assert spans["mserve.stream"]["attrs"]["mserve.chunks"] == 3

    # gRPC, unary and streamed: the traceparent in the call's metadata
    host, port = server.status["grpc_inference"].rsplit(":", 1)
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        grpc_trace = "6" * 32
        answer = stub.Predictions(
            ipb.PredictionsRequest(model_name="echo", input={"data": b"{}"}),
            metadata=[("traceparent", f"00-{grpc_trace}-{CLIENT_SPAN}-01"),
                      ("x-request-id", "grpc-id-7")], timeout=30,
        )  # fmt: skip
        assert json.loads(answer.prediction)["request_id"] == "grpc-id-7"
        spans = receiver.wait_trace(grpc_trace, {"mserve.worker", "mserve.handler"})
        root = next(s for s in spans.values() if s["parent"] == CLIENT_SPAN)
        assert root["name"].startswith("gRPC ")
        assert root["attrs"]["mserve.request_id"] == "grpc-id-7"
        assert spans["mserve.worker"]["parent"] == root["span_id"]
        streamed_trace = "7" * 32
        chunks = list(stub.StreamPredictions(
            ipb.PredictionsRequest(model_name="echo", input={"stream": b"2"}),
            metadata=[("traceparent", f"00-{streamed_trace}-{CLIENT_SPAN}-01")], timeout=30,
        ))  # fmt: skip
        assert chunks
        spans = receiver.wait_trace(streamed_trace, {"mserve.stream"})

    # the model's load was traced too
    wait_until(lambda: any(s["name"] == "mserve.model.load" for s in receiver.spans), 20,
               "the model load's span")  # fmt: skip

    # the JSON access log names the trace and the request id
    access = server.run_dir / "logs" / "access.log"
    wait_until(lambda: "client-id-1" in access.read_text(), 10, "the access log line")
    lines = [json.loads(line) for line in access.read_text().splitlines()]
    line = next(x for x in lines if x.get("request_id") == "client-id-1")
    assert line["trace_id"] == TRACE_ID and line["model"] == "echo" and line["status"] == 200
    assert line["worker"].isdigit() and line["latency_ms"] >= 0


@pytest.mark.parametrize(
    ("settings", "environ", "message"),
    [
        ({"otel_endpoint": "collector:4318"}, {},
         "'otel_endpoint' should be an http:// or https:// URL, found 'collector:4318'"),
        ({"otel_endpoint": "http://c:4318", "otel_protocol": "thrift"}, {},
         "'otel_protocol' should be one of http/protobuf, grpc, found 'thrift'"),
        ({"otel_endpoint": "http://c:4318", "otel_sampling_ratio": 2}, {},
         "'otel_sampling_ratio' should be from 0 to 1, found 2.0"),
        ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_SAMPLER_ARG": "x"},
         "OTEL_TRACES_SAMPLER_ARG should be a number from 0 to 1, found 'x'"),
    ],
)  # fmt: skip
def test_bad_tracing_settings_are_refused_by_name(settings, environ, message) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(flags=settings, environ=environ)
    assert message in str(error.value)


def test_standard_otel_variables_turn_tracing_on_and_off() -> None:
    on = trace_settings(load_config(environ={}), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"})
    assert on is not None and on.endpoint == "http://c:4318/v1/traces"
    assert on.protocol == "http/protobuf" and on.sampling_ratio == 1.0
    assert trace_settings(load_config(environ={}), {}) is None  # off by default
    off = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}
    assert trace_settings(load_config(environ={}), off) is None
