"""``bench_server.py --otel``: what tracing costs the request path.

Two servers in one run: one without tracing, one tracing every request (sampling ratio 1)
exporting over OTLP/HTTP to a local sink (a bare HTTP server in its own process that answers 200
and counts the spans it is sent, decoding OpenTelemetry's protobuf messages). Round by round,
echo (and the MLP, with torch) on each server at 16 connections; the medians of req/s and of
the frontend's CPU per request, the span exporter process's CPU per request (it makes, encodes
and sends the spans: server/tracing/export.py), the ratio on/off, then how many spans the sink
received and how many the server counted as dropped. ``--callgrind N``: the frontend's
instructions per echo request under valgrind, tracing off and on (steady whatever the load).

``python scripts/bench_otel.py --baseline REV``: the span exporter process alone, this tree's
against REV's (``git archive``), alternating round by round: each is fed the same records (a
traced echo request's, 8 spans each, in frames of 64 every 10 ms, as the frontend writes them)
and exports them to the sink; its CPU per request (less a run of one record: the start) and
the spans the sink received.
"""

from __future__ import annotations

import argparse
import json
import marshal
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
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
    """The server's span exporter process (server/tracing/process.py), if it has one."""
    pids = []
    for child in psutil.Process(server.pid).children():
        try:
            if "server.tracing.export" in child.cmdline():
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


REPO = Path(__file__).resolve().parent.parent
FRAME_RECORDS, FRAME_EVERY_S = 64, 0.01


def _record(i: int) -> tuple:
    """A traced echo request's record, as server/tracing/context.py hands it over (8 spans)."""
    start = time.time_ns()
    us = 1000
    children = (start + 50 * us, start + 90 * us, start + 120 * us, start + 900 * us, "1", 1,
                0.6, [["preprocess", 0.0, 0.1], ["inference", 0.1, 0.3],
                      ["postprocess", 0.4, 0.1]], None)  # fmt: skip
    attributes = {"mserve.model": "echo", "mserve.model_version": "1.0",
                  "mserve.request_id": f"{i:032x}"}  # fmt: skip
    return ("q", "POST /predictions/{model}", os.urandom(16).hex(), i + 1, 0, "", start,
            start + 1000 * us, 200, None, attributes, children)  # fmt: skip


def exporter_cpu(tree: Path, endpoint: str, requests: int) -> float:
    """CPU seconds (user + system) of ``python -m server.tracing.export`` from ``tree`` fed
    ``requests`` records and exporting them to ``endpoint``, until it exits (a tree from before
    the tracing package: ``server.tracing_export``)."""
    settings = json.dumps({"endpoint": endpoint, "protocol": "http/protobuf", "headers": {}})
    package = (tree / "server" / "tracing" / "export.py").exists()
    module = "server.tracing.export" if package else "server.tracing_export"
    proc = subprocess.Popen([sys.executable, "-m", module, settings],
                            cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)  # fmt: skip
    assert proc.stdin is not None
    for first in range(0, requests, FRAME_RECORDS):
        data = marshal.dumps(
            [_record(i) for i in range(first, min(requests, first + FRAME_RECORDS))], 4
        )
        proc.stdin.write(struct.pack(">I", len(data)) + data)
        proc.stdin.flush()
        time.sleep(FRAME_EVERY_S)
    proc.stdin.close()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, f"the exporter of {tree} exited with {proc.returncode}"
    return usage.ru_utime + usage.ru_stime


def exporter_rows(baseline: str, requests: int, rounds: int) -> None:
    port = free_port()
    proc = sink(port)
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    with tempfile.TemporaryDirectory(prefix="bench-otel-") as tmp:
        before = Path(tmp)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", baseline, "server", "archiver", "mserve_worker"],
            capture_output=True, check=True,
        )  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
        trees = {baseline: before, "this tree": REPO}
        per_request: dict[str, list[float]] = {k: [] for k in trees}
        print(f"span exporter process alone: {requests} echo requests (8 spans each) per run,"
              f" frames of {FRAME_RECORDS} every {FRAME_EVERY_S * 1000:.0f} ms, {rounds} rounds;"
              f" load average {os.getloadavg()[0]:.1f}")  # fmt: skip
        for _ in range(rounds):
            for name, tree in trees.items():
                received = spans_received(port)
                cpu = exporter_cpu(tree, endpoint, requests) - exporter_cpu(tree, endpoint, 1)
                per_request[name].append(cpu / requests * 1e6)
                got = spans_received(port) - received
                assert got == 8 * (requests + 1), f"{name}: the sink received {got} spans"
        for name, values in per_request.items():
            print(f"  {name:<12} CPU per request {statistics.median(values):6.1f} us (median;"
                  f" runs {', '.join(f'{v:.0f}' for v in values)})")  # fmt: skip
        print(f"  load average after: {os.getloadavg()[0]:.1f}")
    proc.terminate()
    proc.wait(10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the git revision to compare with")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    exporter_rows(args.baseline, args.requests, args.rounds)
