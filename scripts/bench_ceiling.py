"""The HTTP ceiling (``scripts/bench_server.py --ceiling [--callgrind N]``): mserve's echo
path next to bare HTTP echo servers started in the same run, round by round, and the frontend's
instructions per request under callgrind. bench_server.py's docstring says what each row means.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from harness import (
    CALLGRIND,
    Server,
    callgrind_per_call,
    cpu_seconds,
    cpu_split,
    measured,
    medians,
    scale,
)

# --- the HTTP ceiling: the echo path next to bare HTTP servers, same run --------------------

# The least an HTTP server over httptools and uvloop (what server/http/ is built on) can do
# per request: parse, answer the body back, keep the connection. No routing, auth, hop, log.
BARE_HTTPTOOLS = """
import asyncio, httptools, uvloop

class Echo(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.parser, self.body = transport, httptools.HttpRequestParser(self), []

    def data_received(self, data):
        self.parser.feed_data(data)

    def on_body(self, body):
        self.body.append(body)

    def on_message_complete(self):
        body, self.body = b"".join(self.body), []
        self.transport.write(b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\n"
                             b"Content-Length: %d\\r\\n\\r\\n%b" % (len(body), body))

async def main():
    server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()

uvloop.run(main())
"""
# The fair ceiling for a server whose handler runs in another process: the bare httptools
# server above, plus the hop mserve makes: each body goes to a forked worker process over a
# socketpair (4-byte length, the bytes) and comes back before the answer. No batching, routing,
# auth, log or codec: what any such server pays at least. Prints its port and the worker's pid.
BARE_HOP = """
import asyncio, collections, json, os, socket, struct, httptools, uvloop

WORK = lambda body: body  # the worker's work on a body: none (see BARE_HOP_JSON)
parent, child = socket.socketpair()
worker_pid = os.fork()
if worker_pid == 0:
    parent.close()
    while True:
        try:
            head = child.recv(4, socket.MSG_WAITALL)
            if len(head) < 4:
                os._exit(0)
            (n,) = struct.unpack("<I", head)
            body = child.recv(n, socket.MSG_WAITALL) if n else b""
            body = WORK(body)
            child.sendall(struct.pack("<I", len(body)) + body)
        except ConnectionResetError:  # the server was stopped
            os._exit(0)
child.close()
waiting = collections.deque()  # the HTTP transports whose bodies are at the worker, in order

class Worker(asyncio.Protocol):
    def connection_made(self, transport):
        self.buf = b""

    def data_received(self, data):
        self.buf += data
        while len(self.buf) >= 4:
            (n,) = struct.unpack_from("<I", self.buf)
            if len(self.buf) < 4 + n:
                return
            body, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
            client = waiting.popleft()
            if client.is_closing():  # the load generator left (the end of a run)
                continue
            client.write(b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\n"
                         b"Content-Length: %d\\r\\n\\r\\n%b" % (len(body), body))

class Echo(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.parser, self.body = transport, httptools.HttpRequestParser(self), []

    def data_received(self, data):
        self.parser.feed_data(data)

    def on_body(self, body):
        self.body.append(body)

    def on_message_complete(self):
        body, self.body = b"".join(self.body), []
        waiting.append(self.transport)
        worker.write(struct.pack("<I", len(body)) + body)

async def main():
    global worker
    loop = asyncio.get_running_loop()
    worker, _ = await loop.create_connection(Worker, sock=parent)
    server = await loop.create_server(Echo, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], worker_pid, flush=True)
    await asyncio.Event().wait()

uvloop.run(main())
"""
# The same, its worker doing what the echo model's handler contract makes any worker do: the
# JSON body decoded into the handler's row and the answer encoded back (json.loads, json.dumps,
# as a TorchServe handler's ``data`` and return value need). mserve's worker pays this in its
# handler (bench_worker.py's floor); against this row both sides do the same work.
BARE_HOP_JSON = BARE_HOP.replace(
    "WORK = lambda body: body ", "WORK = lambda body: json.dumps(json.loads(body)).encode() "
)
# The same with orjson, as mserve's workers decode and write JSON (mserve_worker/fastjson.py):
# against this row, too, both sides do the same work.
BARE_HOP_ORJSON = BARE_HOP.replace(
    "WORK = lambda body: body ",
    "import orjson\nWORK = lambda body: orjson.dumps(orjson.loads(body)) ",
)
# A raw ASGI echo app on uvicorn (uvloop, httptools, no access log): the frontend ceiling.
BARE_UVICORN = """
import socket, uvicorn

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(app, loop="uvloop", http="httptools", access_log=False,
                              log_level="warning", lifespan="off")).run(sockets=[sock])
"""


class BareEcho:
    """A bare echo server in a process of its own; looks like ``Server`` to the load
    generators (same request: same headers, a dummy bearer token of the same length)."""

    def __init__(self, code: str, headers: dict[str, dict[str, str]],
                 prefix: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.proc = subprocess.Popen([*prefix, sys.executable, "-c", code], text=True,
                                     stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL if prefix else None)  # fmt: skip
        assert self.proc.stdout is not None
        port, *others = self.proc.stdout.readline().split()  # a bare hop: the worker's pid
        self.port = int(port)
        self.host = "127.0.0.1"
        self.pid = self.proc.pid
        self.pids = [self.pid, *map(int, others)]
        self.headers = headers
        deadline = time.monotonic() + 600  # uvicorn binds first, listens later; valgrind is slow
        while True:
            try:
                socket.create_connection((self.host, self.port), timeout=5).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit("the bare echo server did not start") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _dummy_headers(server: Server) -> dict[str, dict[str, str]]:
    token = server.headers["inference"]["Authorization"]
    return {"inference": {"Content-Type": "application/json",
                          "Authorization": "Bearer " + "x" * (len(token) - 7)}}  # fmt: skip


def _bare_run(bare: BareEcho, load, body: bytes, duration: int) -> dict[str, float]:
    """``frontend_us``: CPU per request of every process of the bare server (a bare hop's
    worker included, as mserve's rows add theirs in ``total_us``)."""
    before = cpu_seconds(bare.pids)
    machine = psutil.cpu_times()
    r = load(bare, "/predictions/echo", body, 16, duration)
    r.update(cpu_split(machine, psutil.cpu_times()))
    r["frontend_us"] = (cpu_seconds(bare.pids) - before) / max(r["rps"] * duration, 1.0) * 1e6
    r["worker_us"] = 0.0
    return r


def ceiling_rows(server: Server, load, body: bytes, duration: int, rounds: int) -> None:
    """The echo model, 1 worker, 16 connections, next to bare echo servers on the same
    machine in the same minutes (each round takes every row in turn), then each row's median
    and the frontend's CPU per request over the bare server's (``x bare``)."""
    bares = {"httptools": BARE_HTTPTOOLS, "hop": BARE_HOP, "hop+json": BARE_HOP_JSON,
             "hop+orjson": BARE_HOP_ORJSON}  # fmt: skip
    try:
        import uvicorn  # noqa: F401

        bares["uvicorn"] = BARE_UVICORN
    except ImportError:
        print("uvicorn is not installed: its row is skipped (pip install uvicorn)")
    scale(server, "echo", 1)
    server.request("POST", "/predictions/echo", body)
    results: dict[str, list[dict[str, float]]] = {}
    print(f"{'server':<14} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6}"
          f" {'CPU us/req':>10}  machine CPU during the run")  # fmt: skip

    def row(label: str, r: dict[str, float]) -> str:
        return (f"{label:<14} {r['rps']:>8.0f} {r['p50']:>7.2f} {r['p99']:>7.2f}"
                f" {int(r['errors']):>6} {r['frontend_us']:>10.1f}  busy"
                f" {r['busy']:>3.0f}% steal {r['steal']:>3.0f}% idle {r['idle']:>3.0f}%"
                f" load {r['load']:.1f}")  # fmt: skip

    for n in range(rounds):
        print(f"round {n + 1} of {rounds}")
        r = measured(server, "echo", load, "/predictions/echo", body, 16, duration)
        r["load"] = os.getloadavg()[0]
        results.setdefault("mserve echo", []).append(r)
        print(row("mserve echo", r))
        for name, code in bares.items():
            bare = BareEcho(code, _dummy_headers(server))
            try:
                load(bare, "/predictions/echo", body, 16, 1)  # warm-up
                r = _bare_run(bare, load, body, duration)
            finally:
                bare.stop()
            r["load"] = os.getloadavg()[0]
            results.setdefault(f"bare {name}", []).append(r)
            print(row(f"bare {name}", r))
    print(f"medians over {rounds} round(s):")
    med_rows = {label: medians(runs) for label, runs in results.items()}
    ours = med_rows["mserve echo"]
    for label, med in med_rows.items():
        if label != "mserve echo":
            # a bare hop has a worker process too: compare frontend + worker with it
            hop = label.startswith("bare hop")
            mine = ours["frontend_us"] + (ours["worker_us"] if hop else 0.0)
            ours[f"x {label}"] = mine / med["frontend_us"]
    for label, med in med_rows.items():
        print(row(label, med))
    ratios = ", ".join(f"{k[2:]} {v:.2f}x" for k, v in med_rows["mserve echo"].items()
                       if k.startswith("x bare "))  # fmt: skip
    print(
        f"mserve echo CPU per request over the bare servers': {ratios}"
        f" (against the bare hops: frontend + worker,"
        f" {ours['frontend_us'] + ours['worker_us']:.0f} us)"
    )


def _drive(host: str, port: int, headers: dict[str, str], body: bytes, n: int,
           conns: int = 16) -> None:  # fmt: skip
    """Exactly ``n`` requests over ``conns`` keep-alive connections; every answer must be 200."""
    counts = [n // conns + (i < n % conns) for i in range(conns)]
    failed: list[int] = []

    def go(count: int) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=600)
        for _ in range(count):
            conn.request("POST", "/predictions/echo", body, headers)
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                failed.append(resp.status)
        conn.close()

    threads = [threading.Thread(target=go, args=(c,)) for c in counts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise SystemExit(f"callgrind run: {len(failed)} answer(s) not 200: {failed[:5]}")


def callgrind_rows(work: Path, body: bytes, n: int, extra: str = "", label: str = "",
                   bare: bool = True, key: str | None = None) -> float:  # fmt: skip
    """Instructions per request of the frontend alone (callgrind: user-space instructions,
    the same from run to run whatever the machine's load or steal), N echo requests over 16
    connections after 300 to warm up, and of the bare httptools echo the same way. The worker
    runs natively (valgrind follows no child). ``extra``: more config lines (YAML); ``key``:
    the key sent (default: the server's inference key); returns the frontend's count."""
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        print("valgrind is not installed: no instruction counts (apt-get install valgrind)")
        return 0.0
    out = work / "callgrind.out"
    grind = (*CALLGRIND, f"--callgrind-out-file={out}.%p")
    run_dir = Path(tempfile.mkdtemp(dir=work, prefix="run-callgrind-"))  # one per run
    config = run_dir.with_suffix(".yaml")
    config.write_text(
        "inference_address: 127.0.0.1:0\nmanagement_address: 127.0.0.1:0\n"
        f"metrics_address: 127.0.0.1:0\nmodel_store: {work / 'store'}\n"
        "grpc_inference_address: 127.0.0.1:0\ngrpc_management_address: 127.0.0.1:0\n" + extra
    )
    proc = subprocess.Popen([*grind, sys.executable, "-m", "server.cli", "--start", "--foreground",
                             "--config", str(config), "--run-dir", str(run_dir), "--models",
                             "echo=echo.mar"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        status_file = run_dir / "status.json"
        deadline = time.monotonic() + 1200  # python under valgrind starts ~50x slower
        status: dict[str, object] = {}
        while time.monotonic() < deadline and proc.poll() is None:
            if status_file.exists():
                try:
                    status = json.loads(status_file.read_text())
                except ValueError:
                    status = {}
                if status.get("state") == "ready":
                    break
            time.sleep(1)
        else:
            raise SystemExit("mserve under callgrind did not start")
        if key is None:
            key = json.loads((run_dir / "key_file.json").read_text())["inference"]["key"]
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        host, port = str(status["inference"]).rsplit(":", 1)
        mserve = callgrind_per_call(
            proc.pid, out, lambda k: _drive(host, int(port), headers, body, k), n
        )
    finally:
        proc.terminate()
        proc.wait(120)
    if not bare:
        print(f"instructions per request (callgrind, {n} requests, 16 connections, user space):"
              f" mserve frontend, {label}: {mserve:,.0f}")  # fmt: skip
        return mserve
    bare = BareEcho(BARE_HTTPTOOLS, {}, tuple(grind))
    try:
        headers["Authorization"] = "Bearer " + "x" * len(key)
        plain = callgrind_per_call(bare.pid, out, lambda k: _drive(bare.host, bare.port, headers,
                                                             body, k), n)  # fmt: skip
    finally:
        bare.stop()
    print(f"instructions per request (callgrind, {n} requests, 16 connections, user space):"
          f" mserve frontend {mserve:,.0f}; bare httptools echo {plain:,.0f};"
          f" ratio {mserve / plain:.2f}")  # fmt: skip
    return mserve
