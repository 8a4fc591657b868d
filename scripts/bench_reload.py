"""Hot reload against a worker restart (issue 42's target: a reload of a handler whose weights take
N seconds to load completes in <= 0.2 s + the handler module's import, where a restart pays N).

One model served in place from a folder, ``--workers`` workers, whose handler's "weights" take
``--load-s`` seconds to load and hold ``--weights-mb`` of memory (every page written), kept
across reloads with ``mserve_worker.sdk.keep.keep``. Each round edits the handler (its answer
changes), then times ``PUT /models/bench/reload`` (the client's wall time; every worker prepares
in turn, then all switch) and checks the next answer is the new one and the weights were loaded
once per worker; then times a worker restart: the model scaled to one worker fewer and back
(``synchronous=true``), the new worker loading its weights as at start. Also printed: the
handler module's own import, measured in a fresh interpreter that has already imported what it
imports (what a reload imports again is the model's own modules only).

With ``--conns N``, N client connections ask the model back to back through every reload (not
through the restarts), and the figures say how many requests were answered during the reloads,
how many failed (any status but 200), and their p50 and max latency against the steady state.
``--no-keep`` makes the handler load its weights at every initialize, as a handler that keeps
nothing does: the reload then pays ``--load-s`` per worker, one worker at a time, while the
others serve.

    python scripts/bench_reload.py [--load-s 3] [--weights-mb 64] [--workers 2] [--rounds 5]
                                   [--conns 4] [--no-keep]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BIN, REPO, Server, run

HANDLER = """
import os
import time

from mserve_worker.sdk.keep import keep

ANSWER = {answer!r}


def _load():
    keep("loads", lambda: [0])[0] += 1
    time.sleep({load_s})  # reading and unpickling the weights
    weights = bytearray({size})
    for i in range(0, len(weights), 4096):  # every page written: private memory
        weights[i] = 1
    return weights


class Handler:
    def initialize(self, context):
        self.weights = keep("weights", _load) if {keep} else _load()
        self.loads = keep("loads", lambda: [0])

    def handle(self, data, context):
        return [{{"answer": ANSWER, "loads": self.loads[0], "pid": os.getpid()}} for _ in data]
"""


def write_handler(folder: Path, answer: str, args: argparse.Namespace) -> None:
    size = args.weights_mb * 2**20
    text = HANDLER.format(answer=answer, load_s=args.load_s, size=size, keep=not args.no_keep)
    (folder / "handler.py").write_text(text)


def import_s(folder: Path) -> float:
    """The handler module's own import, its dependencies already imported (median of 5)."""
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); import mserve_worker.sdk.keep;"
        " t = time.perf_counter(); import handler; print(time.perf_counter() - t)"
    )
    times = []
    for _ in range(5):
        out = subprocess.run(
            [sys.executable, "-B", "-c", code, str(folder)], capture_output=True, text=True,
            check=True, cwd=REPO,
        )  # fmt: skip
        times.append(float(out.stdout))
    return statistics.median(times)


def answers(server: Server, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        status, body = server.request("POST", "/predictions/bench", b"{}")
        assert status == 200, body
        out.append(json.loads(body))
    return out


def load(server: Server, conns: int, during: Callable[[], None]) -> list[tuple[int, float]]:
    """(status, seconds) of every request ``conns`` clients sent back to back while ``during``
    ran."""
    rows: list[tuple[int, float]] = []
    done = threading.Event()

    def client() -> None:
        while not done.is_set():
            started = time.perf_counter()
            status, _ = server.request("POST", "/predictions/bench", b"{}")
            rows.append((status, time.perf_counter() - started))

    threads = [threading.Thread(target=client) for _ in range(conns)]
    for thread in threads:
        thread.start()
    try:
        during()
    finally:
        done.set()
        for thread in threads:
            thread.join()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load-s", type=float, default=3.0, help="the weights' load")
    parser.add_argument("--weights-mb", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--conns", type=int, default=0, help="clients asking during reloads")
    parser.add_argument("--no-keep", action="store_true", help="the handler keeps nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-reload-") as tmp:
        work = Path(tmp)
        source = work / "src"
        source.mkdir()
        write_handler(source, "r0", args)
        (work / "store").mkdir()
        run([BIN / "model-archiver", "--model-name", "bench", "--handler", "handler:Handler",
             "--model-path", source, "--export-path", work / "store",
             "--archive-format", "no-archive"])  # fmt: skip
        folder = work / "store" / "bench"
        settings = {"disable_token_authorization": True, "enable_model_api": True,
                    "grpc": False}  # fmt: skip
        server = Server(work, settings)
        try:
            url = f"/models?url=bench&initial_workers={args.workers}&synchronous=true"
            status, body = server.request("POST", url, api="management")
            assert status == 200, body
            reloads, server_s, restarts = [], [], []
            steady = load(server, args.conns, lambda: time.sleep(1.0)) if args.conns else None
            during: list[tuple[int, float]] = []
            for i in range(1, args.rounds + 1):
                write_handler(folder, f"r{i}", args)
                started = time.perf_counter()

                def reload() -> None:
                    status, body = server.request("PUT", "/models/bench/reload", api="management")
                    assert status == 200, body
                    server_s.append(json.loads(body)["seconds"])

                if args.conns:
                    during += load(server, args.conns, reload)
                else:
                    reload()
                reloads.append(time.perf_counter() - started)
                got = answers(server, 2 * args.workers)
                assert {a["answer"] for a in got} == {f"r{i}"}, got
                if not args.no_keep:
                    assert {a["loads"] for a in got} == {1}, got  # kept: loaded once per worker
                fewer = f"/models/bench?min_worker={args.workers - 1}&synchronous=true"
                status, body = server.request("PUT", fewer, api="management")
                assert status == 200, body
                started = time.perf_counter()
                back = f"/models/bench?min_worker={args.workers}&synchronous=true"
                status, body = server.request("PUT", back, api="management")
                restarts.append(time.perf_counter() - started)
                assert status == 200, body
                print(f"round {i}: reload {reloads[-1]:.3f} s (server {server_s[-1]:.3f} s),"
                      f" worker restart {restarts[-1]:.2f} s", flush=True)  # fmt: skip
        finally:
            server.stop()
        module_s = import_s(folder)
    reload_s = statistics.median(reloads)
    restart_s = statistics.median(restarts)
    print(f"\nhandler weights' load: {args.load_s:g} s, {args.weights_mb} MiB;"
          f" {args.workers} workers; {args.rounds} rounds (medians)")  # fmt: skip
    print(f"  hot reload, all {args.workers} workers:  {reload_s:.3f} s"
          f"  (server-side {statistics.median(server_s):.3f} s)")  # fmt: skip
    print(f"  worker restart (one worker): {restart_s:.3f} s")
    print(f"  handler module's import:     {module_s * 1000:.1f} ms")
    if steady is not None:
        for label, rows in (("steady", steady), ("during reloads", during)):
            ms = sorted(t * 1000 for _, t in rows)
            failed = sum(1 for status, _ in rows if status != 200)
            print(f"  {args.conns} clients, {label}: {len(rows)} requests, {failed} failed,"
                  f" p50 {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms")  # fmt: skip
    target = 0.2 + module_s
    verdict = "met" if reload_s <= target else "MISSED"
    print(f"  target: reload <= 0.2 s + import = {target:.3f} s: {verdict};"
          f" restart / reload = {restart_s / reload_s:.0f}x")  # fmt: skip


if __name__ == "__main__":
    main()
