"""Streaming benchmark: many small chunks through a real mserve, figures printed.

Usage: python scripts/bench_streaming.py [--chunks 1000] [--size 8] [--rounds 3]

Two handlers stream ``--chunks`` chunks of ``--size`` bytes per request, as fast as they can:
``ts`` calls TorchServe's ``send_intermediate_predict_response`` per chunk, ``gen`` returns a
generator. Each row runs 1 stream alone (batch_size 1), then 8 concurrent streams (one batch of
8 on one worker, each request its own stream), ``--rounds`` times, and prints the best round:

- ``chunks/s``: chunks received per second over all streams (the "tokens per second" figure);
- ``per stream``: the same for one stream;
- ``first chunk``: median time from sending the request to reading its first chunk, while
  the handler floods the stream (the server and the worker share the CPU with the client);
- ``total``: wall time of the round;
- ``cpu/chunk``: CPU time per chunk of the frontend and of the worker (steadier than chunks/s
  on a shared VM, where the hypervisor steals time).

A last line gives the time to the first chunk of a stream whose handler is not flooding it
(2 chunks; median of 50 requests, one at a time, per handler): the latency a client waits for
its first token.

Chunks are read off a raw socket and counted as they arrive (the client parses the chunked
framing itself, so the figure is the server's, not a client library's buffering).
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
from harness import Server, archive

HANDLERS = {
    "ts": """
from ts.handler_utils.utils import send_intermediate_predict_response

def handle(data, context):
    if not data:
        return None
    specs = [row.get("body") or {} for row in data]
    n = max(s["n"] for s in specs)
    for i in range(n - 1):
        ret = [b"x" * s["size"] for s in specs]
        send_intermediate_predict_response(ret, context.request_ids, "", 200, context)
    return [b"x" * s["size"] for s in specs]
""",
    "gen": """
def _tokens(n, size):
    token = b"x" * size
    for _ in range(n):
        yield token

def handle(data, context):
    if not data:
        return None
    return [_tokens(row["body"]["n"], row["body"]["size"]) for row in data]
""",
}


def stream(address: tuple[str, int], model: str, body: bytes) -> tuple[float, int, float]:
    """(seconds to the first chunk, chunks, seconds to the end) of one streamed request."""
    sock = socket.create_connection(address, timeout=120)
    started = time.perf_counter()
    sock.sendall(
        f"POST /predictions/{model} HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head, _, buf = buf.partition(b"\r\n\r\n")
    if b" 200 " not in head.split(b"\r\n")[0] or b"chunked" not in head.lower():
        raise SystemExit(f"not a streamed answer: {head!r}")
    first = 0.0
    chunks = 0
    while True:
        while b"\r\n" not in buf:
            buf += sock.recv(65536)
        line, _, buf = buf.partition(b"\r\n")
        size = int(line, 16)
        while len(buf) < size + 2:
            buf += sock.recv(65536)
        buf = buf[size + 2 :]
        if size == 0:
            break
        chunks += 1
        if chunks == 1:
            first = time.perf_counter() - started
    sock.close()
    return first, chunks, time.perf_counter() - started


def cpu_s(pids: list[int]) -> float:
    """CPU seconds of the processes: from /proc/PID/schedstat (nanoseconds) where there is one,
    since cpu_times() counts 10 ms clock ticks, too coarse for a round of 1,000 chunks."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
        except OSError:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


def round_of(
    address: tuple[str, int], model: str, streams: int, body: bytes, pids: list[int]
) -> dict[str, float]:
    results: list[tuple[float, int, float]] = [(0.0, 0, 0.0)] * streams
    barrier = threading.Barrier(streams)

    def one(i: int) -> None:
        barrier.wait()
        results[i] = stream(address, model, body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    frontend_before, worker_before = cpu_s(pids[:1]), cpu_s(pids[1:])
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = time.perf_counter() - started
    frontend, worker = cpu_s(pids[:1]) - frontend_before, cpu_s(pids[1:]) - worker_before
    chunks = sum(r[1] for r in results)
    return {
        "chunks_s": chunks / total,
        "per_stream": statistics.median(r[1] / r[2] for r in results),
        "first_ms": statistics.median(r[0] for r in results) * 1000,
        "total_s": total,
        "chunks": chunks,
        "frontend_us": frontend / chunks * 1e6,
        "worker_us": worker / chunks * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=1000, help="chunks per request")
    parser.add_argument("--size", type=int, default=8, help="bytes per chunk")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per row (best is shown)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mserve-bench-stream-") as tmp:
        work = Path(tmp)
        for name, code in HANDLERS.items():
            module = work / f"{name}_stream.py"  # not ts.py: it would hide the ts package
            module.write_text(code)
            archive(work / "store", name, "--handler", f"{module}:handle")
        # loopback only; it registers its models and measures streaming, not keys
        # (scripts/bench_server.py runs with token authorization on)
        settings = {"grpc": False, "disable_token_authorization": True, "enable_model_api": True}
        server = Server(work, settings)
        try:
            status = server.status
            address = (server.host, server.port)
            manage = http.client.HTTPConnection(*status["management"].rsplit(":", 1), timeout=120)
            body = json.dumps({"n": args.chunks, "size": args.size}).encode()
            print(f"{args.chunks} chunks of {args.size} bytes per request; one worker;"
                  f" best of {args.rounds} rounds")  # fmt: skip
            print(f"{'handler':8} {'streams':>7} {'chunks/s':>10} {'per stream':>11}"
                  f" {'first chunk':>12} {'total':>8}  cpu/chunk frontend, worker")  # fmt: skip
            for name in HANDLERS:
                for streams in (1, 8):
                    model = f"{name}{streams}"
                    manage.request(
                        "POST", f"/models?url={name}.mar&model_name={model}&batch_size={streams}"
                        "&max_batch_delay=200&initial_workers=1&synchronous=true",
                    )  # fmt: skip
                    reply = manage.getresponse()
                    if reply.status != 200:
                        raise SystemExit(f"registering {model} failed: {reply.read()!r}")
                    reply.read()
                    manage.request("GET", f"/models/{model}")
                    described = json.loads(manage.getresponse().read())
                    pids = [status["pid"], *(w["pid"] for w in described[0]["workers"])]
                    stream(address, model, body)  # warm-up
                    rows = [
                        round_of(address, model, streams, body, pids) for _ in range(args.rounds)
                    ]
                    best = max(rows, key=lambda r: r["chunks_s"])
                    assert best["chunks"] == streams * args.chunks, best
                    print(f"{name:8} {streams:>7} {best['chunks_s']:>10,.0f}"
                          f" {best['per_stream']:>11,.0f} {best['first_ms']:>10.2f}ms"
                          f" {best['total_s']:>7.3f}s  {best['frontend_us']:6.1f} us,"
                          f" {best['worker_us']:6.1f} us")  # fmt: skip
            short = json.dumps({"n": 2, "size": args.size}).encode()
            firsts = {
                name: statistics.median(stream(address, f"{name}1", short)[0] for _ in range(50))
                for name in HANDLERS
            }
            print("first chunk, 2-chunk streams (median of 50): "
                  + ", ".join(f"{n} {t * 1000:.2f} ms" for n, t in firsts.items()))  # fmt: skip
        finally:
            server.stop()


if __name__ == "__main__":
    main()
