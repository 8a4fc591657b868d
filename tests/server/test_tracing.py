"""OpenTelemetry traces end to end: a real server exporting over OTLP/HTTP to a real receiver in
this test (an HTTP server decoding ``ExportTraceServiceRequest`` with opentelemetry-proto), or over
OTLP/gRPC to a real TraceService server, real workers running tests/handlers/trace_echo (a
BaseHandler subclass echoing its trace context)."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import marshal
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import psutil
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from packaging.version import Version

from server.config import load_config
from server.errors import ConfigError
from server.rpc.protos import inference_pb2 as ipb
from server.rpc.protos import inference_pb2_grpc
from server.tracing.export import FRAME
from server.tracing.settings import trace_settings
from tests.conftest import REPO
from tests.server.conftest import HANDLERS, Server, wait_until
from tests.server.conftest import http as http_request

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


class Receiver:
    """An OTLP/HTTP traces endpoint: every span it is sent, with its attributes, by span id."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []  # each post's, names in lower case
        self.lock = threading.Lock()
        self.refuse = False  # answer 400: the collector refuses what it is sent
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                if receiver.refuse:
                    self.send_response(400)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
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


class GrpcReceiver(Receiver):
    """An OTLP/gRPC traces endpoint: a real TraceService server; keeps each call's metadata."""

    def __init__(self) -> None:
        from concurrent import futures

        self.spans, self.lock = [], threading.Lock()
        self.metadata: list[dict[str, str]] = []
        self.refuse = False  # abort with INVALID_ARGUMENT
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> ExportTraceServiceResponse:
                receiver.metadata.append(dict(context.invocation_metadata()))
                if receiver.refuse:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "spans refused by the test")
                receiver.add(request)
                return ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.url = f"http://127.0.0.1:{port}"


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

    # refused before it is queued (no such model): its id answered, its span made, an error
    refused_trace = "4" * 32
    reply = server.predict(
        "nosuch",
        {},
        headers={
            "traceparent": f"00-{refused_trace}-{CLIENT_SPAN}-01",
            "X-Request-ID": "refused-1",
        },
    )
    assert reply.status == 404 and _header(reply, "x-request-id") == "refused-1"
    refused = receiver.wait_trace(refused_trace, {"POST /predictions"})["POST /predictions"]
    assert refused["parent"] == CLIENT_SPAN and refused["status"] == 2
    assert refused["attrs"]["http.response.status_code"] == 404
    assert refused["attrs"]["mserve.model"] == "nosuch"
    assert refused["attrs"]["mserve.request_id"] == "refused-1"

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
        refused_trace = "8" * 32
        with pytest.raises(grpc.RpcError):
            stub.Predictions(
                ipb.PredictionsRequest(model_name="nosuch", input={"data": b"{}"}),
                metadata=[("traceparent", f"00-{refused_trace}-{CLIENT_SPAN}-01")], timeout=30,
            )  # fmt: skip
        wait_until(lambda: any(s["trace_id"] == refused_trace for s in receiver.spans), 20,
                   "the refused gRPC call's span")  # fmt: skip
        refused = next(s for s in receiver.spans if s["trace_id"] == refused_trace)
        assert refused["name"].startswith("gRPC ") and refused["status"] == 2
        assert refused["attrs"]["mserve.model"] == "nosuch"

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


def test_open_inference_protocol_grpc_calls_are_traced(make_archive, start_server) -> None:
    """KServe's and Triton's gRPC ModelInfer: the call's traceparent parents its server span,
    whose children are the request's queue, batch and worker, as for TorchServe's APIs."""
    # Triton's client's messages (as tests/server/test_oip_grpc.py): ours define the same
    # proto names, which one process's descriptor pool takes only once
    grpc_client = pytest.importorskip("tritonclient.grpc")
    oip_pb2, oip_pb2_grpc = grpc_client.service_pb2, grpc_client.service_pb2_grpc

    receiver = Receiver()
    try:
        make_archive("oip_models", "echo_tensors:handle", "tensors",
                     "--config-file", str(HANDLERS / "oip_models" / "echo_config.yaml"))  # fmt: skip
        server = start_server("tensors=tensors.mar", config={"otel_endpoint": receiver.url})
        host, port = server.status["grpc_inference"].rsplit(":", 1)
        request = oip_pb2.ModelInferRequest(model_name="tensors", id="oip-traced")
        entry = request.inputs.add(name="x", datatype="INT32", shape=[2])
        entry.contents.int_contents.extend([1, 2])
        trace = "9" * 32
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            answer = oip_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                request, metadata=[("traceparent", f"00-{trace}-{CLIENT_SPAN}-01"),
                                   ("x-request-id", "oip-rid")], timeout=30,
            )  # fmt: skip
        assert answer.id == "oip-traced" and answer.outputs[0].name == "x"
        name = "gRPC inference.GRPCInferenceService"
        spans = receiver.wait_trace(trace, {name, "mserve.queue", "mserve.worker"})
        root = spans[name]
        assert root["parent"] == CLIENT_SPAN and root["status"] != 2
        assert root["attrs"]["mserve.model"] == "tensors"
        assert root["attrs"]["mserve.request_id"] == "oip-rid"
        for child in ("mserve.queue", "mserve.worker"):
            assert spans[child]["parent"] == root["span_id"], child
    finally:
        receiver.server.shutdown()


def test_generative_requests_spans(make_archive, start_server) -> None:
    """A continuous-batching request's handler span and phases are those of the step that gave
    its first chunk (its time to first token; the worker runs the steps itself), the batch
    size that step's requests. An OpenAI streamed chat is traced as a prediction is: its
    server span (with OpenTelemetry's gen_ai attributes and its usage) under the client's, the
    queue, worker and handler spans of its job, and its stream's events."""
    receiver = Receiver()
    generator = HANDLERS / "generator"
    make_archive("generator", "generator:Generator", "gen", "--config-file",
                 str(generator / "model-config.yaml"))  # fmt: skip
    make_archive("generative", "lm:handle", "chat", "--config-file",
                 str(HANDLERS / "generative" / "chat.yaml"))  # fmt: skip
    server = start_server("gen=gen.mar", "chat=chat.mar", config={"otel_endpoint": receiver.url})
    try:
        trace = "8" * 32
        reply = server.predict("gen", {"name": "a", "tokens": 4, "sleep": 0.05},
                               headers={"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"})  # fmt: skip
        assert reply.status == 200, reply.body
        tokens = [json.loads(x)["token"] for x in reply.body.splitlines()]
        assert tokens == ["a:0", "a:1", "a:2", "a:3"]
        names = {"POST /predictions", "mserve.worker", "mserve.handler", "mserve.preprocess",
                 "mserve.inference", "mserve.postprocess", "mserve.stream"}  # fmt: skip
        spans = receiver.wait_trace(trace, names)
        root, worker = spans["POST /predictions"], spans["mserve.worker"]
        handler, inference = spans["mserve.handler"], spans["mserve.inference"]
        assert handler["parent"] == worker["span_id"]
        assert inference["parent"] == handler["span_id"]
        assert root["attrs"]["mserve.batch_size"] == 1
        # one step (its 0.05 s sleep), not the four (>= 0.2 s); the stream holds the others
        handled = handler["end"] - handler["start"]
        assert 0.045e9 <= inference["end"] - inference["start"] <= handled < 0.15e9
        assert handler["end"] <= worker["end"] <= spans["mserve.stream"]["start"] + 1e6
        assert spans["mserve.stream"]["attrs"]["mserve.chunks"] == 4

        client = openai.OpenAI(base_url=server.url("inference", "/openai/v1"), api_key="none",
                               max_retries=0, timeout=30)  # fmt: skip
        chat_trace = "9" * 32
        events = list(client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "say: one two three"}],
            stream=True, stream_options={"include_usage": True},
            extra_headers={"traceparent": f"00-{chat_trace}-{CLIENT_SPAN}-01"},
        ))  # fmt: skip
        used = events[-1].usage
        assert used is not None and used.completion_tokens > 0
        names = {"POST /openai/v1/chat/completions", "mserve.queue", "mserve.worker",
                 "mserve.handler", "mserve.stream"}  # fmt: skip
        spans = receiver.wait_trace(chat_trace, names)
        root = spans["POST /openai/v1/chat/completions"]
        assert root["parent"] == CLIENT_SPAN
        assert root["attrs"]["gen_ai.operation.name"] == "chat"
        assert root["attrs"]["gen_ai.request.model"] == "chat"
        assert root["attrs"]["gen_ai.usage.input_tokens"] == used.prompt_tokens
        assert root["attrs"]["gen_ai.usage.output_tokens"] == used.completion_tokens
        assert root["attrs"]["http.response.status_code"] == 200
        for child in ("mserve.queue", "mserve.worker", "mserve.stream"):
            assert spans[child]["parent"] == root["span_id"], child
        assert spans["mserve.handler"]["parent"] == spans["mserve.worker"]["span_id"]
        assert spans["mserve.stream"]["attrs"]["mserve.chunks"] == len(events)

        # refused before it is queued (no such model): its span all the same, with the error
        refused_trace = "7" * 32
        with pytest.raises(openai.NotFoundError) as refused:
            client.chat.completions.create(
                model="nosuch", messages=[{"role": "user", "content": "hi"}],
                extra_headers={"traceparent": f"00-{refused_trace}-{CLIENT_SPAN}-01",
                               "X-Request-ID": "openai-refused"},
            )  # fmt: skip
        assert refused.value.response.headers["x-request-id"] == "openai-refused"
        name = "POST /openai/v1/chat/completions"
        root = receiver.wait_trace(refused_trace, {name})[name]
        assert root["parent"] == CLIENT_SPAN and root["status"] == 2
        assert root["attrs"]["http.response.status_code"] == 404
        assert root["attrs"]["gen_ai.request.model"] == "nosuch"
        assert root["attrs"]["mserve.request_id"] == "openai-refused"
    finally:
        receiver.server.shutdown()


def _exporters(server: Server) -> list[psutil.Process]:
    """The server's span exporter children, live ones only."""
    return _exporters_of(psutil.Process(server.pid))


def _exporters_of(parent: psutil.Process) -> list[psutil.Process]:
    found = []
    for child in parent.children():
        try:
            if "server.tracing.export" in child.cmdline():
                found.append(child)
        except psutil.Error:  # gone, or a zombie not reaped yet
            pass
    return found


def _dropped(server: Server, reason: str) -> float:
    text = http_request("GET", server.url("metrics", "/metrics")).body.decode()
    line = f'mserve_trace_spans_dropped_total{{reason="{reason}"}} '
    return next(float(x[len(line) :]) for x in text.splitlines() if x.startswith(line))


def test_the_exporter_process_is_restarted_and_its_failures_counted_and_logged_once(
    traced,
) -> None:
    """Spans are made and sent by a child of the server: killed, it is restarted and its exit
    logged; a collector refusing batches costs counted spans and one warning, then one line
    when it works again."""
    server, receiver = traced
    log = server.run_dir / "logs" / "mserve.log"
    assert server.predict("echo", {"x": 1}, headers={"traceparent": TRACEPARENT}).status == 200
    receiver.wait_trace(TRACE_ID, {"POST /predictions", "mserve.handler"})
    (child,) = _exporters(server)
    child.kill()
    wait_until(lambda: [p.pid for p in _exporters(server)] not in ([], [child.pid]), 20,
               "a new span exporter process")  # fmt: skip
    second = "8" * 32
    server.predict("echo", {"x": 2}, headers={"traceparent": f"00-{second}-{CLIENT_SPAN}-01"})
    receiver.wait_trace(second, {"POST /predictions", "mserve.handler"})
    assert log.read_text().count("the span exporter process exited with code -9") == 1

    receiver.refuse = True
    for _ in range(3):  # three batches refused, one after the other
        want = _dropped(server, "export_failed") + 8
        assert server.predict("echo", {"x": 3}).status == 200
        wait_until(lambda want=want: _dropped(server, "export_failed") >= want, 20,
                   "the refused spans counted")  # fmt: skip
    failed = f"exporting spans to {receiver.url} failed: Failed to export spans batch code: 400"
    assert log.read_text().count(failed) == 1
    receiver.refuse = False
    third = "9" * 32
    server.predict("echo", {"x": 4}, headers={"traceparent": f"00-{third}-{CLIENT_SPAN}-01"})
    receiver.wait_trace(third, {"POST /predictions"})
    lost = int(_dropped(server, "export_failed"))
    wait_until(lambda: f"works again; {lost} spans were lost" in log.read_text(), 10,
               "the recovery logged")  # fmt: skip
    assert _dropped(server, "queue_full") == 0


def test_a_stalled_exporter_costs_counted_drops_and_one_warning_per_burst(caplog) -> None:
    """The queue to a child that stopped reading is bounded: what does not fit is dropped and
    counted, with one warning when the burst starts and one when the queue drains; the child,
    resumed, exports what it was sent. Real child process and receiver; the request path's
    records are put directly."""
    from server.tracing.process import MAX_QUEUE, ExportProcess
    from server.tracing.settings import TraceSettings

    receiver = Receiver()
    process = ExportProcess(TraceSettings(receiver.url, "http/protobuf", 1.0))
    trace = "a" * 32

    async def run() -> None:
        process.start()
        assert process._proc is not None
        child = psutil.Process(process._proc.pid)
        child.suspend()
        try:
            for i in range(MAX_QUEUE * 4):
                process.put(("s", "mserve.model.load", trace, i + 1, 0, 1, 2, {"i": i}, None))
            assert process.dropped["queue_full"] > 0
        finally:
            child.resume()
        for _ in range(600):  # bounded: 30 s
            if not process._records and not process._pending:
                break
            await asyncio.sleep(0.05)
        await process.close()

    with caplog.at_level(logging.WARNING, logger="server.tracing"):
        asyncio.run(run())
    receiver.server.shutdown()
    dropped = process.dropped["queue_full"]
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("falling behind" in w for w in warnings) == 1, warnings
    assert f"tracing: the span queue drained; {dropped} spans were dropped" in warnings
    assert len(receiver.trace(trace)) == MAX_QUEUE * 4 - dropped


@pytest.mark.parametrize(
    ("environ", "sent"),
    [
        # W3C baggage format: percent-decoded, as the SDK's parse_env_headers(liberal=True)
        ({"OTEL_EXPORTER_OTLP_HEADERS": "api-key=s%3Dcret%20key,X-Team=a b"},
         {"api-key": "s=cret key", "x-team": "a b"}),
        # the signal's own variable wins over the generic one (the OpenTelemetry specification)
        ({"OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=generic,api-key=k",
          "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-tenant=team%20a"},
         {"x-tenant": "team a"}),
    ],
)  # fmt: skip
def test_otlp_headers_reach_the_collector_as_the_sdk_reads_them(environ, sent, monkeypatch) -> None:
    """``OTEL_EXPORTER_OTLP_[TRACES_]HEADERS``, parsed once: the headers a real exporter process
    sends a real receiver; none of them on the exporter's command line (any user's ``ps``
    shows it)."""
    from server import tracing

    for name in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    receiver = Receiver()
    argv: list[str] = []

    async def run() -> None:
        tracer = tracing.setup(load_config(flags={"otel_endpoint": receiver.url}, environ={}))
        assert tracer is not None
        tracer.start()
        argv.extend(next(iter(_exporters_of(psutil.Process()))).cmdline())
        with tracing.span("mserve.model.load"):
            pass
        await tracer.close()

    try:
        asyncio.run(run())
    finally:
        tracing.setup(load_config(environ={}), {})
        receiver.server.shutdown()
    assert len(receiver.spans) == 1
    assert {k: v for k, v in receiver.headers[0].items() if k in sent or k == "api-key"} == sent
    assert not any("api-key" in arg or "x-tenant" in arg or "X-Team" in arg for arg in argv)


def _floors(requirements: list[str], names: tuple[str, ...] = ()) -> dict[str, str]:
    """``name>=version`` requirements' floors, by name (only ``names`` when given)."""
    floors = {}
    for requirement in requirements:
        name, sep, version = requirement.partition(">=")
        name = name.split("[")[0].strip()
        if not names or name in names:
            assert sep, f"{requirement}: no floor"
            floors[name] = version.split(",")[0].strip()
    return floors


@pytest.mark.slow
def test_the_exporter_runs_on_the_oldest_opentelemetry_the_otel_extra_allows() -> None:
    """The otel extra's floors (and the exporter's other dependencies' floors), installed on
    their own (once, into .cache/otel-floor) and nothing else but the standard library: the
    exporter process sends a span with the standard variables' headers to a real receiver.
    (opentelemetry-api before 1.27 has no ``parse_env_headers(..., liberal=True)``.)"""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    otel = _floors(project["optional-dependencies"]["otel"])
    assert "opentelemetry-api" in otel  # the tracing package imports it: declared
    others = _floors(project["dependencies"], ("httpx",))  # the exporter's OTLP/HTTP sender
    pins = sorted(f"{n}=={v}" for n, v in (otel | others).items())
    home = REPO / ".cache" / "otel-floor" / "-".join(p.replace("==", "") for p in pins)
    if not (home / ".complete").exists():  # written last: a run killed halfway is redone
        shutil.rmtree(home, ignore_errors=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(home), *pins],
            check=True, timeout=600,
        )  # fmt: skip
        (home / ".complete").write_text("\n".join(pins))
    env = {**os.environ, "PYTHONPATH": f"{home}{os.pathsep}{REPO}",
           "OTEL_EXPORTER_OTLP_HEADERS": "api-key=s%3Dcret,x-team=a b"}  # fmt: skip
    python = [sys.executable, "-S"]  # no site-packages: only what was installed there
    versions = subprocess.run(
        [*python, "-c", "from importlib.metadata import version as v; "
         "print(*(v(n) for n in ('opentelemetry-api', 'opentelemetry-sdk')))"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    found = [Version(v) for v in versions.stdout.split()]
    assert found == [Version(otel["opentelemetry-api"]), Version(otel["opentelemetry-sdk"])]
    receiver = Receiver()
    data = marshal.dumps([("s", "mserve.model.load", "b" * 32, 1, 0, 1, 2, {}, None)], 4)
    try:
        out = subprocess.run(
            [*python, "-m", "server.tracing.export",
             json.dumps({"endpoint": receiver.url, "protocol": "http/protobuf"})],
            input=FRAME.pack(len(data)) + data, env=env, capture_output=True, timeout=60,
        )  # fmt: skip
    finally:
        receiver.server.shutdown()
    assert out.returncode == 0, out.stderr.decode()
    assert [s["name"] for s in receiver.trace("b" * 32)] == ["mserve.model.load"]
    assert receiver.headers[0]["api-key"] == "s=cret" and receiver.headers[0]["x-team"] == "a b"


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
    # 0: only what a client's sampled traceparent asks for is traced
    zero = load_config(
        flags={"otel_endpoint": "http://c:4318", "otel_sampling_ratio": 0}, environ={}
    )
    assert trace_settings(zero, {}).sampling_ratio == 0.0
    with pytest.raises(ConfigError, match="otel_sampling_ratio"):
        load_config(flags={"otel_sampling_ratio": -0.5}, environ={})
    off = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}
    assert trace_settings(load_config(environ={}), off) is None
    # the TRACES variables win over the generic ones; an empty one counts as unset
    both = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}  # fmt: skip
    traces = trace_settings(load_config(environ={}), both)
    assert traces is not None and (traces.endpoint, traces.protocol) == ("http://t:4317", "grpc")
    both |= {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "", "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift",
             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}  # fmt: skip
    generic = trace_settings(load_config(environ={}), both)
    assert generic is not None and generic.endpoint == "http://c:4318/v1/traces"


def test_sampling_follows_the_clients_flag_else_the_ratio() -> None:
    """Request spans are sampled as the SDK's ParentBased(TraceIdRatioBased) would: a valid
    client traceparent's flag decides, else the ratio; an unsampled request is never handed
    to the exporter."""
    from server.tracing.context import Tracing
    from server.tracing.settings import TraceSettings

    handed: list[Any] = []
    sink = type("Sink", (), {"put": lambda self, record: handed.append(record)})()

    def tracing(ratio: float) -> Tracing:
        settings = TraceSettings("http://127.0.0.1:9/", "http/protobuf", ratio)
        return Tracing(settings, sink)

    never, always = tracing(0.0), tracing(1.0)
    sampled_out = f"00-{TRACE_ID}-{CLIENT_SPAN}-00"
    cases = [
        (never, {}, False), (always, {}, True), (never, {"traceparent": TRACEPARENT}, True),
        (always, {"traceparent": sampled_out}, False),
        (never, {"traceparent": "00-" + "0" * 32 + f"-{CLIENT_SPAN}-01"}, False),  # invalid
    ]  # fmt: skip
    for tracer, carrier, sampled in cases:
        trace = tracer.begin("POST /predictions/{model}", carrier, "rid", "m", "1", 0.0)
        assert trace.sampled is sampled, carrier
        assert trace.traceparent.endswith("-01" if sampled else "-00")
        if carrier and carrier["traceparent"][3:35] == TRACE_ID:
            assert trace.trace_id == TRACE_ID and trace.parent_id == int(CLIENT_SPAN, 16)
        handed.clear()
        trace.finish(None, 200)
        assert len(handed) == int(sampled)


def test_spans_are_exported_over_grpc_with_the_standard_headers(make_archive, start_server) -> None:
    """``otel_protocol: grpc``: the same spans reach a real TraceService server, with the
    headers of ``OTEL_EXPORTER_OTLP_HEADERS`` as metadata; a refused export is logged with the
    collector's status and counted."""
    receiver = GrpcReceiver()
    make_archive("trace_echo", "trace_echo:TraceEcho", "echo")
    server = start_server(
        "echo=echo.mar", config={"otel_endpoint": receiver.url, "otel_protocol": "grpc"},
        env={"OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-tenant=team%20a"},
    )  # fmt: skip
    try:
        assert server.predict("echo", {"x": 1}, headers={"traceparent": TRACEPARENT}).status == 200
        names = {"POST /predictions", "mserve.queue", "mserve.batch", "mserve.worker",
                 "mserve.handler", "mserve.preprocess", "mserve.inference", "mserve.postprocess"}  # fmt: skip
        spans = receiver.wait_trace(TRACE_ID, names)
        root = spans["POST /predictions"]
        assert root["parent"] == CLIENT_SPAN and root["attrs"]["mserve.model"] == "echo"
        assert root["attrs"]["http.response.status_code"] == 200
        assert spans["mserve.worker"]["parent"] == root["span_id"]
        assert spans["mserve.handler"]["parent"] == spans["mserve.worker"]["span_id"]
        assert spans["mserve.inference"]["parent"] == spans["mserve.handler"]["span_id"]
        assert receiver.metadata[-1]["x-tenant"] == "team a"

        receiver.refuse = True
        assert server.predict("echo", {"x": 2}).status == 200
        wait_until(lambda: _dropped(server, "export_failed") >= 8, 20, "the refused spans counted")
        log = server.run_dir / "logs" / "mserve.log"
        failed = (f"exporting spans to {receiver.url} failed: Failed to export spans batch, "
                  "error code: INVALID_ARGUMENT, details: spans refused by the test")  # fmt: skip
        wait_until(lambda: failed in log.read_text(), 10, "the refusal logged")
    finally:
        receiver.server.stop(0)
