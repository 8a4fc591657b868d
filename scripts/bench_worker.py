"""Worker cost per request: one real worker process driven over its socket, beside the floor.

Usage: python scripts/bench_worker.py [--models echo,mlp] [--batches 1,8] [--rounds 3]
       python scripts/bench_worker.py --callgrind [--requests 2000]
       python scripts/bench_worker.py --cprofile [--models echo]

A real worker (``python -m mserve_worker.runtime --fd N``: the runtime's socket loop, the
service, the codec) gets INIT for the model as the server sends it, then BATCH frames of 1 or
``batch`` requests one after another (one in flight: each batch costs one recv and one send), with
the headers a client like wrk sends; every RESULT is checked (200, one answer per request). With
one in flight the worker waits, idle, for every batch, and a CPU woken from idle runs the next
forward slower (scripts/bench_interference.py: 1.25x after 0.15 ms here); ``--in-flight 2``
keeps the next batch in its socket, as the server's pump does under load. The
floor is the same handler, loaded the same way, called in a plain loop on the same body with JSON
in and out (each body decoded as the worker decodes it, ``mserve_worker.fastjson.loads``: orjson
where installed, else ``json.loads``; ``handle([{"body": ...}], context)``, ``json.dumps`` each
answer): what the handler itself costs, which no worker can avoid. Worker minus floor is what
serving a request costs the worker; the issue's goal is to make it small.

Figures, per request (a batch of 8 counts as 8):

- default: CPU time (user + system, from /proc) of the worker process and of the floor process,
  ``--requests`` requests per run, worker and floor taking turns for ``--rounds`` rounds, then
  the medians. CPU time moves less than wall time on this shared VM, but still moves: compare
  only figures of one run.
- ``--callgrind``: the same under valgrind's callgrind, user-space instructions counted from
  after a warm-up to the end of ``--requests`` requests, the same from run to run whatever the
  machine's load (valgrind runs Python ~50x slower: minutes, more for the MLP's torch import).
- ``--cprofile``: the worker under cProfile for ``--requests`` requests; prints the functions
  taking the most time of their own (where the worker's part goes).

echo: a module-function handler returning each request's body (scripts/harness.py), body
``{"data": [256 x 0.5]}``; mlp: examples/mlp (torch, one thread), body ``{"data": [256 floats]}``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pstats
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from harness import CALLGRIND, ECHO_HANDLER, REPO, callgrind_per_call, run

from mserve_worker import fastjson, protocol
from mserve_worker.context import Context
from mserve_worker.protocol import Frame, Kind, RequestItem

START_TIMEOUT_S = 1200  # torch imported under valgrind
BODIES = {
    "echo": json.dumps({"data": [0.5] * 256}).encode(),
    "mlp": json.dumps({"data": [0.01 * i for i in range(256)]}).encode(),
}


def model_dir(work: Path, model: str) -> tuple[Path, str, dict[str, Any]]:
    """The model's folder as the server extracts it, its handler and its manifest."""
    folder = work / model
    folder.mkdir(parents=True, exist_ok=True)
    if model == "echo":
        (folder / "echo.py").write_text(ECHO_HANDLER)
        return folder, "echo:handle", {"model": {"modelName": "echo", "handler": "echo.py"}}
    mlp = REPO / "examples" / "mlp"
    for name in ("handler.py", "model.py"):
        shutil.copy(mlp / name, folder / name)
    run([sys.executable, mlp / "make_weights.py", folder / "mlp.pt"])
    manifest = {"model": {"modelName": "mlp", "handler": "handler.py", "serializedFile": "mlp.pt"}}
    return folder, "handler:handle", manifest


def _init(model: str, folder: Path, handler: str, manifest: dict, batch: int) -> dict[str, Any]:
    return {"model_name": model, "model_dir": str(folder), "handler": handler,
            "manifest": manifest, "batch_size": batch, "gpu_id": None}  # fmt: skip


class Worker:
    """A real worker process on a socket pair, INIT sent and READY read."""

    in_flight = 1  # batches sent before the first answer is read (--in-flight)

    def __init__(self, python: list[str], init: dict[str, Any], log: Path) -> None:
        parent, child = socket.socketpair()
        self.sock = parent
        self.decoder = protocol.Decoder()
        self.frames: list[Frame] = []
        self.log = log.open("wb")
        self.proc = subprocess.Popen(
            [*python, "-m", "mserve_worker.runtime", "--fd", str(child.fileno())],
            pass_fds=(child.fileno(),), stdout=self.log, stderr=self.log, cwd=REPO,
        )  # fmt: skip
        child.close()
        self.pid = self.proc.pid
        parent.settimeout(START_TIMEOUT_S)
        if self._receive().kind != Kind.HELLO:
            raise SystemExit("the worker did not say HELLO")
        self._send(Frame(Kind.INIT, init))
        ready = self._receive()
        if ready.kind != Kind.READY:
            raise SystemExit(f"the worker did not load: {ready.meta} (log: {log})")
        self.batch_id = 0

    def _send(self, frame: Frame) -> None:
        self.sock.sendall(protocol.encode_bytes(frame))

    def _receive(self) -> Frame:
        while not self.frames:
            data = self.sock.recv(1 << 18)
            if not data:
                raise SystemExit(f"the worker closed the channel (log: {self.log.name})")
            self.frames.extend(self.decoder.feed(data))
        return self.frames.pop(0)

    def drive(self, batches: int, items: list[RequestItem]) -> None:
        """``batches`` BATCH frames of ``items``, ``in_flight`` of them sent before the first
        answer is read (then one sent per answer); every answer must be 200."""
        sent = 0
        for _ in range(min(self.in_flight, batches)):
            self._send_batch(items)
            sent += 1
        for _ in range(batches):
            reply = self._receive()
            if sent < batches:
                self._send_batch(items)
                sent += 1
            if reply.kind != Kind.RESULT:
                raise SystemExit(f"batch failed: {reply.meta}")
            _, responses = protocol.parse_result(reply)
            if len(responses) != len(items) or any(r.status != 200 for r in responses):
                raise SystemExit(f"bad answers: {[r.status for r in responses]}")

    def _send_batch(self, items: list[RequestItem]) -> None:
        self.batch_id += 1
        self._send(protocol.batch_frame(self.batch_id, items, check=False))

    def stop(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Floor:
    """The floor in a process of its own (this script's ``--floor-child``), driven by lines."""

    def __init__(self, python: list[str], init: dict[str, Any], batch: int, log: Path) -> None:
        self.log = log.open("wb")
        self.proc = subprocess.Popen(
            [*python, __file__, "--floor-child", json.dumps(init), str(batch)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, cwd=REPO,
        )  # fmt: skip
        self.pid = self.proc.pid
        if self._line() != "ready":
            raise SystemExit(f"the floor did not load (log: {log})")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().decode().strip()

    def drive(self, batches: int, items: list[RequestItem]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{batches}\n".encode())
        self.proc.stdin.flush()
        if self._line() != "done":
            raise SystemExit(f"the floor failed (log: {self.log.name})")

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)
        self.log.close()


def floor_child(init: dict[str, Any], batch: int) -> None:
    """The handler alone: loaded as the worker loads it (module-function: ``handle(None,
    context)`` first), then ``handle`` on freshly decoded rows, each answer encoded."""
    folder = init["model_dir"]
    sys.path.insert(0, folder)
    os.chdir(folder)
    context = Context(init["model_name"], folder, init["manifest"], batch, None, "mserve", "")
    module_name, _, function = init["handler"].partition(":")
    handle = getattr(importlib.import_module(module_name), function)
    handle(None, context)
    body = BODIES[init["model_name"]]
    print("ready", flush=True)
    for line in sys.stdin:
        for _ in range(int(line)):
            rows = [{"body": fastjson.loads(body)} for _ in range(batch)]
            for out in handle(rows, context):
                json.dumps(out).encode()
        print("done", flush=True)


def _items(model: str, batch: int) -> list[RequestItem]:
    body = BODIES[model]
    headers = [["Host", "127.0.0.1:8080"], ["Content-Length", str(len(body))],
               ["Content-Type", "application/json"],
               ["Authorization", "Bearer " + "k" * 32]]  # fmt: skip
    return [RequestItem(f"{i:08x}-5c1e-4d2b-9f3a-0123456789ab", "application/json", headers, body)
            for i in range(batch)]  # fmt: skip


def cpu_per_request(proc: Worker | Floor, items: list[RequestItem], requests: int) -> float:
    """Microseconds of CPU (user + system) the process spends per request."""
    batches = max(1, requests // len(items))
    proc.drive(max(1, batches // 10), items)  # warm up
    process = psutil.Process(proc.pid)
    before = process.cpu_times()
    proc.drive(batches, items)
    after = process.cpu_times()
    spent = after.user + after.system - before.user - before.system
    return spent / (batches * len(items)) * 1e6


def cpu_rows(work: Path, cases: list[tuple[str, int]], requests: int, rounds: int) -> None:
    print(f"CPU per request (us, user + system), {requests} requests per run, medians of "
          f"{rounds} rounds; wall-clock noise on a shared VM moves these by ~10%")  # fmt: skip
    for model, batch in cases:
        folder, handler, manifest = model_dir(work, model)
        init = _init(model, folder, handler, manifest, batch)
        items = _items(model, batch)
        worker = Worker([sys.executable], init, work / f"{model}-{batch}-worker.log")
        floor = Floor([sys.executable], init, batch, work / f"{model}-{batch}-floor.log")
        try:
            served, bare = [], []
            for _ in range(rounds):
                served.append(cpu_per_request(worker, items, requests))
                bare.append(cpu_per_request(floor, items, requests))
        finally:
            worker.stop()
            floor.stop()
        w, f = statistics.median(served), statistics.median(bare)
        print(f"{model} batch {batch}: worker {w:.1f} us, floor {f:.1f} us, worker - floor "
              f"{w - f:.1f} us, floor / worker {f / w:.2f}")  # fmt: skip


def callgrind_rows(work: Path, cases: list[tuple[str, int]], requests: int) -> None:
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    print(f"instructions per request (callgrind, user space, {requests} requests after a "
          f"warm-up, {Worker.in_flight} batch(es) in flight)")  # fmt: skip
    for model, batch in cases:
        folder, handler, manifest = model_dir(work, model)
        init = _init(model, folder, handler, manifest, batch)
        items = _items(model, batch)
        batches = max(1, requests // batch)
        counts = {}
        for label, kind in (("worker", Worker), ("floor", Floor)):
            out = work / f"callgrind-{model}-{batch}-{label}"
            python = [*CALLGRIND, f"--callgrind-out-file={out}.%p", sys.executable]
            log = work / f"{model}-{batch}-{label}.log"
            proc = kind(python, init, log) if kind is Worker else kind(python, init, batch, log)
            try:
                per_batch = callgrind_per_call(
                    proc.pid, out, lambda k, p=proc, i=items: p.drive(k, i), batches,
                    warmup=max(20, batches // 10),
                )  # fmt: skip
            finally:
                proc.stop()
            counts[label] = per_batch / batch
        w, f = counts["worker"], counts["floor"]
        print(f"{model} batch {batch}: worker {w:,.0f}, floor {f:,.0f}, worker - floor "
              f"{w - f:,.0f} instructions per request", flush=True)  # fmt: skip


def cprofile_rows(work: Path, cases: list[tuple[str, int]], requests: int) -> None:
    for model, batch in cases:
        folder, handler, manifest = model_dir(work, model)
        init = _init(model, folder, handler, manifest, batch)
        out = work / f"{model}-{batch}.prof"
        # the whole worker's life, INIT included: load is a one-off next to the requests
        python = [sys.executable, "-m", "cProfile", "-o", str(out)]
        worker = Worker(python, init, work / f"{model}-profile.log")
        worker.drive(max(1, requests // batch), _items(model, batch))
        worker.stop()
        print(f"--- {model} batch {batch}: {requests} requests, by own time")
        stats = pstats.Stats(str(out)).sort_stats("tottime")
        stats.print_stats(25)
        if os.environ.get("BENCH_WORKER_CALLERS"):  # e.g. "stat|isinstance": who calls them
            stats.print_callers(os.environ["BENCH_WORKER_CALLERS"])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--floor-child":
        floor_child(json.loads(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="echo,mlp", help="comma-separated: echo, mlp")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--requests", type=int, default=0,
                        help="requests per run (default 5000; 2000 under --callgrind)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true",
                        help="keep the work folder (callgrind, cProfile files, logs)")  # fmt: skip
    parser.add_argument("--in-flight", type=int, default=1,
                        help="batches in the worker's socket at once (the server keeps 2-8;"
                        " with 1 the worker waits for every batch, idle)")  # fmt: skip
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--callgrind", action="store_true", help="instructions per request")
    mode.add_argument("--cprofile", action="store_true", help="where the worker's time goes")
    args = parser.parse_args()
    requests = args.requests or (2000 if args.callgrind else 5000)
    Worker.in_flight = max(1, args.in_flight)
    models = [m for m in args.models.split(",") if m]
    for model in models:
        if model not in BODIES:
            raise SystemExit(f"unknown model {model!r}: expected echo or mlp")
    cases = [(m, int(b)) for m in models for b in args.batches.split(",") if b]
    work = Path(tempfile.mkdtemp(prefix="bench-worker-"))
    started = time.perf_counter()
    try:
        if args.callgrind:
            callgrind_rows(work, cases, requests)
        elif args.cprofile:
            cprofile_rows(work, cases, requests)
        else:
            cpu_rows(work, cases, requests, args.rounds)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
