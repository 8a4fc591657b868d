"""In-place swap under load (issue 42's target: peak memory <= budget + one worker, measured, and
no failed or refused request).

One model, two versions of a handler that holds ``--weights-mb`` of private memory per worker
(its "weights", every page written). A first server measures one worker's PSS; the measured
server's ``worker_memory_budget_mb`` then fits ``--workers`` workers and not one more. Version
1.0 serves with ``--workers`` workers, 2.0 is registered with none. ``--conns`` client
connections ask for the model by name (no version) back to back; after ``--steady`` seconds of
that, ``PUT /models/bench/1.0/swap?to=2.0&synchronous=true``; the load goes on ``--after``
seconds past its answer. Workers are exec'd (``fork_workers: false``), so each one's PSS is its
own; ``--fork`` forks them from a warm template (the default mode), whose PSS is left out as the
budget leaves it out. ``--overlap`` swaps with ``overlap=true``: B's worker starts before A's
drains.

A sampler reads the PSS of every process under the server from /proc every 20 ms. Printed: the
budget, one worker's PSS, the peak of the workers' PSS during the swap against budget + one
worker, the server's own figure (describe's ``swap.peakMemoryBytes``), how long the swap took,
and the requests during it: answered by each version, failed (any status but 200), p50/p99
against the steady state before it.

    python scripts/bench_swap.py [--workers 3] [--weights-mb 64] [--conns 16] [--rounds 1]
                                 [--fork] [--overlap]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Client, Machine, Server, archive

MIB = 2**20
BASE = {"disable_token_authorization": True, "enable_model_api": True, "grpc": False,
        "fork_workers": False}  # fmt: skip
HANDLER = """
import os

WEIGHTS = None


def handle(data, context):
    global WEIGHTS
    if data is None:
        WEIGHTS = bytearray({size})
        for i in range(0, len(WEIGHTS), 4096):  # every page written: private memory
            WEIGHTS[i] = 1
        return None
    version = context.manifest["model"]["modelVersion"]
    return [{{"version": version, "pid": os.getpid()}} for _ in data]
"""


def workers_pss(server: Server) -> list[int]:
    """The PSS of each worker: every process under the server but its worker templates (which
    the budget does not count)."""
    sizes = []
    for proc in server.processes()[1:]:
        try:
            if "mserve_worker.template" in " ".join(proc.cmdline()) and proc.ppid() == server.pid:
                continue
            sizes.append(proc.memory_full_info().pss)
        except psutil.Error:
            continue
    return sizes


class Load:
    """``conns`` keep-alive connections asking for the model by name, each answer recorded as
    (time, status, version, latency); a PSS sampler beside them."""

    def __init__(self, server: Server, conns: int) -> None:
        self.server = server
        self.client = Client(server.status["inference"], server.headers["inference"])
        self.answers: list[tuple[float, int, str, float]] = []
        self.samples: list[tuple[float, int, int]] = []  # (time, sum, largest)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._ask) for _ in range(conns)]
        self._threads.append(threading.Thread(target=self._sample))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _ask(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                status, body = self.client.request("POST", "/predictions/bench", b"{}")
            except OSError as exc:
                status, body = 0, str(exc).encode()
            took = time.perf_counter() - t0
            version = json.loads(body).get("version", "") if status == 200 else body.decode()
            self.answers.append((t0, status, version, took))

    def _sample(self) -> None:
        while not self._stop.is_set():
            sizes = workers_pss(self.server)
            self.samples.append((time.perf_counter(), sum(sizes), max(sizes, default=0)))
            time.sleep(0.02)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000 if ordered else 0.0


def one_round(work: Path, args: argparse.Namespace, one_bytes: int, n: int) -> dict[str, float]:
    budget_mb = int((args.workers + 0.5) * one_bytes / MIB) + 1
    settings = {**BASE, "fork_workers": args.fork, "worker_memory_budget_mb": budget_mb,
                "load_wait_s": 30}  # fmt: skip
    server = Server(work, settings, name=f"swap{n}")
    try:
        for version, workers in (("1.0", args.workers), ("2.0", 0)):
            status, answer = server.request(
                "POST", f"/models?url=bench_{version}.mar&initial_workers={workers}"
                "&synchronous=true", api="management",
            )  # fmt: skip
            assert status == 200, answer
        with Load(server, args.conns) as load:
            time.sleep(args.steady)
            began = time.perf_counter()
            status, answer = server.request(
                "PUT", f"/models/bench/1.0/swap?to=2.0&synchronous=true&overlap={args.overlap}",
                api="management",
            )  # fmt: skip
            ended = time.perf_counter()
            assert status == 200, answer
            time.sleep(args.after)
        _, described = server.request("GET", "/models/bench/2.0", api="management")
        swap = json.loads(described)[0]["swap"]
    finally:
        server.stop()
    during = [a for a in load.answers if began <= a[0] <= ended]
    steady = [a for a in load.answers if a[0] < began]
    peak = max(s for t, s, _ in load.samples if began <= t <= ended + 0.5)
    largest = max(big for _t, _s, big in load.samples)
    return {
        "budget_mb": budget_mb,
        "one_worker_mb": one_bytes / MIB,
        "largest_worker_mb": largest / MIB,
        "peak_mb": peak / MIB,
        "limit_mb": budget_mb + largest / MIB,
        "server_peak_mb": swap["peakMemoryBytes"] / MIB,
        "swap_s": ended - began,
        "requests": len(during),
        "failed": sum(1 for a in during if a[1] != 200),
        "by_1.0": sum(1 for a in during if a[2] == "1.0"),
        "by_2.0": sum(1 for a in during if a[2] == "2.0"),
        "failed_all": sum(1 for a in load.answers if a[1] != 200),
        "steady_p50": percentile([a[3] for a in steady], 0.5),
        "steady_p99": percentile([a[3] for a in steady], 0.99),
        "swap_p50": percentile([a[3] for a in during], 0.5),
        "swap_p99": percentile([a[3] for a in during], 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--weights-mb", type=int, default=64)
    parser.add_argument("--conns", type=int, default=16)
    parser.add_argument("--steady", type=float, default=3.0)
    parser.add_argument("--after", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--fork", action="store_true", help="workers forked from a template")
    parser.add_argument("--overlap", action="store_true",
                        help="swap with overlap=true (B's worker before A's drains)")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-swap-") as tmp:
        work = Path(tmp)
        (work / "weighty.py").write_text(HANDLER.format(size=args.weights_mb * MIB))
        for version in ("1.0", "2.0"):
            archive(work / "store", "bench", "--handler", work / "weighty.py", "--version", version)
            (work / "store" / "bench.mar").rename(work / "store" / f"bench_{version}.mar")
        machine = Machine()
        probe = Server(work, {**BASE, "fork_workers": args.fork}, name="probe")
        try:
            status, answer = probe.request(
                "POST", "/models?url=bench_1.0.mar&initial_workers=1&synchronous=true",
                api="management",
            )  # fmt: skip
            assert status == 200, answer
            one = max(workers_pss(probe))
        finally:
            probe.stop()
        rows = [one_round(work, args, one, n) for n in range(args.rounds)]
    how = "forked from a template" if args.fork else "exec'd"
    how += ", overlap=true" if args.overlap else ""
    print(f"bench_swap: {args.workers} workers ({how}) of {args.weights_mb} MB weights,"
          f" {args.conns} connections, {args.rounds} round(s), medians;"
          f" {machine.since()}")  # fmt: skip
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"budget {med['budget_mb']:.0f} MiB (fits {args.workers} workers of"
          f" {med['one_worker_mb']:.1f} MiB PSS, not {args.workers + 1})")  # fmt: skip
    print(f"peak workers' PSS during the swap (/proc, every 20 ms): {med['peak_mb']:.1f} MiB;"
          f" budget + one worker: {med['limit_mb']:.1f} MiB"
          f" (peak {med['peak_mb'] / med['budget_mb']:.2f}x the budget);"
          f" the server's own figure: {med['server_peak_mb']:.1f} MiB")  # fmt: skip
    print(f"swap took {med['swap_s']:.2f} s; requests during it: {med['requests']:.0f}"
          f" (1.0: {med['by_1.0']:.0f}, 2.0: {med['by_2.0']:.0f}), failed: {med['failed']:.0f};"
          f" failed over the whole run: {med['failed_all']:.0f}")  # fmt: skip
    print(f"latency ms: steady p50 {med['steady_p50']:.1f} p99 {med['steady_p99']:.1f};"
          f" during the swap p50 {med['swap_p50']:.1f} p99 {med['swap_p99']:.1f}")  # fmt: skip
    for n, r in enumerate(rows):
        print(f"round {n}: " + json.dumps({k: round(v, 2) for k, v in r.items()}))


if __name__ == "__main__":
    main()
