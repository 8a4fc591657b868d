"""``bench_server.py --inference-log``: what inference logging costs the request path.

Echo and (with torch) the MLP, each registered twice on one server: as is, and with the
inference log on for every request (``inference_log=all``, sample 1) into both sinks, the
JSON-lines file and a CloudEvents receiver (a bare HTTP server in its own process answering
200). Round by round, each model without then with logging at 16 connections; the medians and
the ratio with/without, then what the sinks did (sent, dropped, failed) from the metrics port.
A receiver slower than the server makes the logger drop (counted) rather than slow requests.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import quote

from harness import Server, free_port, medians, wait_until

RECEIVER = textwrap.dedent("""
    import sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")
CONNECTIONS = 16
BATCH = 32  # records per send: one file write, 32 events posted together


def receiver(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port)])

    def listening() -> bool:
        import socket

        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_until(listening, 10, "the CloudEvents receiver")
    return proc


def register(server: Server, archive: str, name: str, url: str | None) -> None:
    path = f"/models?url={archive}&model_name={name}&initial_workers=1"
    if url is not None:
        path += (f"&inference_log=all&inference_log_batch={BATCH}"
                 f"&inference_log_url={quote(url, safe='')}")  # fmt: skip
    status, body = server.request("POST", path, api="management")
    assert status == 200, body


def sink_counts(server: Server) -> dict[tuple[str, str, str], float]:
    _, text = server.request("GET", "/metrics", api="metrics")
    out = {}
    pattern = r"^mserve_inference_log_records_total\{([^}]*)\} (\S+)$"
    for labels, value in re.findall(pattern, text.decode(), re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[(got["model"], got["sink"], got["outcome"])] = float(value)
    return out


def inference_log_rows(
    work: Path, load, bodies: dict[str, bytes], duration: int, rounds: int, measured
) -> None:  # fmt: skip
    """``measured(server, model, load, path, body, conns, duration)``: bench_server's run."""
    port = free_port()
    proc = receiver(port)
    try:
        server = Server(work, {"enable_model_api": True}, name="inflog")
        url = f"http://127.0.0.1:{port}/"
        archives = {"echo": "echo.mar", "mlp": "mlp.mar"}
        for model in bodies:
            register(server, archives[model], model, None)
            register(server, archives[model], f"{model}_log", url)
        print(f"inference log: all, sample 1, batch {BATCH}, file + CloudEvents;"
              f" {CONNECTIONS} connections, {rounds} rounds of {duration} s")  # fmt: skip
        print(f"{'model':<10} {'off req/s':>10} {'on req/s':>10} {'on/off':>7}"
              f" {'off us':>8} {'on us':>8}  (frontend CPU per request)")  # fmt: skip
        for model, body in bodies.items():
            runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
            for name in (model, f"{model}_log"):  # warm both
                server.request("POST", f"/predictions/{name}", body)
            for _ in range(rounds):
                for key, name in (("off", model), ("on", f"{model}_log")):
                    runs[key].append(measured(server, name, load, f"/predictions/{name}", body,
                                              CONNECTIONS, duration))  # fmt: skip
            off, on = medians(runs["off"]), medians(runs["on"])
            print(f"{model:<10} {off['rps']:>10.0f} {on['rps']:>10.0f}"
                  f" {on['rps'] / off['rps']:>7.2f} {off['frontend_us']:>8.0f}"
                  f" {on['frontend_us']:>8.0f}")  # fmt: skip
        counts = sink_counts(server)
        for (model, sink, outcome), value in sorted(counts.items()):
            print(f"  {model} {sink} {outcome}: {value:.0f}")
        server.stop()
    finally:
        proc.terminate()
        proc.wait(10)
