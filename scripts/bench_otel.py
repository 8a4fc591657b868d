"""``bench_server.py --otel``: what tracing costs the request path.

Two servers in one run: one without tracing, one tracing every request (sampling ratio 1)
exporting over OTLP/HTTP to a local sink (a bare HTTP server in its own process that answers 200
and counts the spans it is sent, decoding OpenTelemetry's protobuf messages). Round by round,
echo (and the MLP, with torch) on each server at 16 connections; the medians of req/s and of
the frontend's CPU per request, the span exporter process's CPU per request (it makes, encodes
and sends the spans: server/tracing_export.py), the ratio on/off, then how many spans the sink
received and how many the server counted as dropped. ``--callgrind N``: the frontend's
instructions per echo request under valgrind, tracing off and on (steady whatever the load).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import psutil
from harness import Server, cpu_seconds, free_port, medians, wait_until

SINK = textwrap.dedent("""
    import json, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    spans, lock = [0], threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            request = ExportTraceServiceRequest()
            request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            n = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            with lock:
                spans[0] += n
            self.reply(b"")

        def do_GET(self):
            self.reply(json.dumps({"spans": spans[0]}).encode())

        def reply(self, body):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")
CONNECTIONS = 16


def sink(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", SINK, str(port)])

    def listening() -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).read()
        except OSError:
            return False
        return True

    wait_until(listening, 10, "the OTLP sink")
    return proc


def spans_received(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as reply:
        return int(json.loads(reply.read())["spans"])


def exporter_pids(server: Server) -> list[int]:
    """The server's span exporter process (server/tracing_process.py), if it has one."""
    pids = []
    for child in psutil.Process(server.pid).children():
        try:
            if "server.tracing_export" in child.cmdline():
                pids.append(child.pid)
        except psutil.Error:
            pass
    return pids


def dropped(server: Server) -> int:
    """mserve_trace_spans_dropped_total, all reasons."""
    port = server.status["urls"]["metrics"]
    with urllib.request.urlopen(f"{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    prefix = "mserve_trace_spans_dropped_total{"
    return int(sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(prefix)))


def otel_rows(
    work: Path, load, bodies: dict[str, bytes], duration: int, rounds: int, measured,
    callgrind=None,
) -> None:  # fmt: skip
    """``measured(server, model, load, path, body, conns, duration)``: bench_server's run;
    ``callgrind(work, body, n, config_lines, label)``: its instruction count, or None."""
    port = free_port()
    proc = sink(port)
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    try:
        archives = {"echo": "echo.mar", "mlp": "mlp.mar"}
        models = [f"{m}={archives[m]}" for m in bodies]
        servers = {
            "off": Server(work, {"enable_model_api": True}, models, name="otel-off"),
            "on": Server(work, {"enable_model_api": True, "otel_endpoint": endpoint,
                                "otel_sampling_ratio": 1.0}, models, name="otel-on"),
        }  # fmt: skip
        print(f"tracing: off, and on at sampling 1 exporting OTLP/HTTP to a local sink;"
              f" {CONNECTIONS} connections, {rounds} rounds of {duration} s")  # fmt: skip
        print(f"{'model':<10} {'off req/s':>10} {'on req/s':>10} {'on/off':>7}"
              f" {'off us':>8} {'on us':>8} {'export us':>9}  (CPU per request: frontend,"
              f" exporter process)")  # fmt: skip
        for model, body in bodies.items():
            runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
            for server in servers.values():  # warm both
                server.request("POST", f"/predictions/{model}", body)
            for _ in range(rounds):
                for key, server in servers.items():
                    pids = exporter_pids(server)
                    before = cpu_seconds(pids)
                    run = measured(server, model, load, f"/predictions/{model}", body,
                                   CONNECTIONS, duration)  # fmt: skip
                    run["export_us"] = (cpu_seconds(pids) - before) / max(
                        run["rps"] * duration, 1.0) * 1e6  # fmt: skip
                    runs[key].append(run)
            off, on = medians(runs["off"]), medians(runs["on"])
            print(f"{model:<10} {off['rps']:>10.0f} {on['rps']:>10.0f}"
                  f" {on['rps'] / off['rps']:>7.2f} {off['frontend_us']:>8.0f}"
                  f" {on['frontend_us']:>8.0f} {on['export_us']:>9.0f}")  # fmt: skip
        lost = dropped(servers["on"])
        for server in servers.values():
            server.stop()  # the traced one exports what it still holds
        print(
            f"  spans received by the sink: {spans_received(port)}; dropped by the server: {lost}"
        )
        if callgrind is not None:
            off = callgrind(work, bodies["echo"], "", "tracing off")
            on = callgrind(work, bodies["echo"], f"otel_endpoint: {endpoint}\n", "tracing on")
            print(f"  instructions per echo request: on/off {on / off:.3f}")
    finally:
        proc.terminate()
        proc.wait(10)
