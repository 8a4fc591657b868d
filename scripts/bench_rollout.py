"""Canary rollouts under load (issue 42's targets: a rollout from A to B under 16 connections
with 0 failed or refused requests and a p99 during it <= 2x the steady state's; a bad B, one
that answers 500 or one 3x slower, rolled back within one guard window with at most the
canary's share of the requests affected).

One model, four versions of tests/handlers/rollout/versioned.py, each with ``--workers``
workers and a handler that sleeps ``--delay-ms`` per batch (so latency, not this VM's two
cores, sets the pace): 1.0 (A), 2.0 (a good B), 3.0 (a B that raises: 500s) and 4.0 (a B that
sleeps 3x as long). ``--conns`` client threads ask for the model by name (no version), back to
back, recording each answer's time, status, latency and the version that served it.

1. steady: A alone for ``--steady`` seconds: p50, p99;
2. rollout: ``POST /models/bench/canary`` of 2.0 (steps 5/25/50/100 %, ``--interval`` s each,
   ``--window`` s guard window) until it is promoted: failed requests (any status but 200),
   p50/p99 during it against the steady state's, each version's share;
3. bad B, 500s: a canary of 3.0 over the new default until it is rolled back: time from its
   start to the rollback in guard windows, requests failed against all answered meanwhile and
   against the canary's first share, the reason the server gave;
4. bad B, 3x slower: the same with 4.0.

``--seam``: instead, the routing seam's own cost per request for a model with no policy, in
this process: ``Router.pick`` against ``registry.get`` and ``Router.after_enqueue``, ns per
call (the hot path's share of a request that costs the server ~200 us of CPU).

    python scripts/bench_rollout.py [--conns 16] [--workers 2] [--delay-ms 10] [--steady 8]
                                    [--interval 2] [--window 1] | --seam
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, Client, Server, archive

HANDLER = REPO / "tests" / "handlers" / "rollout"
STEPS = [5, 25, 50, 100]


class Load:
    """``conns`` threads asking for the model by name, back to back, until stopped; each
    answer kept as (start, latency s, status, version)."""

    def __init__(self, server: Server, conns: int) -> None:
        self.client = Client(server.status["inference"], server.headers["inference"])
        self.conns = conns
        self.rows: list[tuple[float, float, int, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(conns)]

    def _run(self) -> None:
        mine = []
        body = json.dumps({"x": 1}).encode()
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                status, answer = self.client.request("POST", "/predictions/bench", body)
            except OSError:
                status, answer = 0, b""  # refused or reset: counts as failed
            latency = time.perf_counter() - t0
            version = json.loads(answer).get("version", "") if status == 200 else ""
            mine.append((t0, latency, status, version))
        with self._lock:
            self.rows.extend(mine)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def between(self, start: float, end: float) -> list[tuple[float, float, int, str]]:
        return [r for r in self.rows if start <= r[0] < end]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _figures(rows: list[tuple[float, float, int, str]]) -> dict[str, Any]:
    latencies = [r[1] for r in rows if r[2] == 200]
    versions: dict[str, int] = {}
    for r in rows:
        versions[r[3] or f"status {r[2]}"] = versions.get(r[3] or f"status {r[2]}", 0) + 1
    return {
        "requests": len(rows),
        "failed": sum(r[2] != 200 for r in rows),
        "p50_ms": _percentile(latencies, 0.5) * 1000,
        "p99_ms": _percentile(latencies, 0.99) * 1000,
        "versions": versions,
    }


def _manage(server: Server, method: str, path: str, doc: Any = None) -> dict[str, Any]:
    status, body = server.request(
        method, path, json.dumps(doc).encode() if doc is not None else b"", api="management"
    )
    if status != 200:
        raise SystemExit(f"{method} {path}: {status} {body.decode()}")
    return json.loads(body)  # type: ignore[no-any-return]


def _wait_state(server: Server, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _manage(server, "GET", "/models/bench/canary")
        if state["state"] != "running":
            return state
        time.sleep(0.05)
    raise SystemExit(f"the canary is still running after {timeout_s} s: {state}")


def _canary(
    server: Server, load: Load, version: str, args: argparse.Namespace
) -> tuple[dict[str, Any], float, float]:
    plan = {"version": version, "steps": STEPS, "interval_s": args.interval,
            "window_s": args.window, "min_requests": args.min_requests}  # fmt: skip
    started = time.perf_counter()
    _manage(server, "POST", "/models/bench/canary", plan)
    state = _wait_state(server, args.interval * len(STEPS) * 10 + 60)
    ended = time.perf_counter()
    time.sleep(0.2)  # the answers in flight at the end come back
    served = _manage(server, "GET", "/models/bench/traffic")["served"]
    state["servedByServer"] = {v: s["requests"] for v, s in served.items()}
    _manage(server, "DELETE", "/models/bench/canary")
    return state, started, ended


def run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    store = work / "store"
    faults = {"1.0": {}, "2.0": {}, "3.0": {"fail": True},
              "4.0": {"delay_ms": 3 * args.delay_ms}}  # fmt: skip
    for version, fault in faults.items():
        config = work / f"{version}.yaml"
        rollout_test = {"delay_ms": args.delay_ms, **fault}
        config.write_text(json.dumps({"minWorkers": args.workers, "maxWorkers": args.workers,
                                      "rollout_test": rollout_test}))  # fmt: skip
        archive(store, f"bench{version[0]}", "--version", version, "--handler",
                "versioned:handle", "--model-path", HANDLER, "--config-file", config)  # fmt: skip
    server = Server(work, {"disable_token_authorization": True, "enable_model_api": True,
                           "grpc": False})  # fmt: skip
    try:
        for version in faults:
            _manage(server, "POST", f"/models?url=bench{version[0]}.mar&model_name=bench")
        print(f"{args.conns} connections, {args.workers} worker(s) per version, handler"
              f" {args.delay_ms} ms per batch; canary steps {STEPS} %, {args.interval} s each,"
              f" guard window {args.window} s, min_requests {args.min_requests}")  # fmt: skip
        with Load(server, args.conns) as load:
            time.sleep(1.0)  # connections open, workers warm
            t0 = time.perf_counter()
            time.sleep(args.steady)
            t1 = time.perf_counter()
            good, g0, g1 = _canary(server, load, "2.0", args)
            bad = [(_canary(server, load, v, args), v) for v in ("3.0", "4.0")]
        steady = _figures(load.between(t0, t1))  # each thread's rows are in once it ended
        rollout = _figures(load.between(g0, g1))
        print(f"steady (A alone, {args.steady:g} s): {steady['requests']} requests,"
              f" {steady['failed']} failed, p50 {steady['p50_ms']:.1f} ms,"
              f" p99 {steady['p99_ms']:.1f} ms")  # fmt: skip
        print(f"rollout A -> B ({g1 - g0:.1f} s, {good['state']}): {rollout['requests']}"
              f" requests, {rollout['failed']} failed or refused, p50 {rollout['p50_ms']:.1f} ms,"
              f" p99 {rollout['p99_ms']:.1f} ms = {rollout['p99_ms'] / steady['p99_ms']:.2f}x"
              f" steady; served by {rollout['versions']}")  # fmt: skip
        for (state, b0, b1), version in bad:
            during = _figures(load.between(b0, b1))
            share = during["failed"] / during["requests"] if during["requests"] else 0.0
            print(f"bad B {version} ({'500s' if version == '3.0' else '3x slower'}):"
                  f" {state['state']} after {b1 - b0:.2f} s = {(b1 - b0) / args.window:.1f}"
                  f" guard windows; {during['requests']} requests meanwhile, {during['failed']}"
                  f" failed ({share:.1%}; the canary's first share {STEPS[0]} %), served by"
                  f" {during['versions']} (the server's count: {state['servedByServer']}),"
                  f" p99 {during['p99_ms']:.1f} ms; reason: {state['reason']}")  # fmt: skip
    finally:
        server.stop()


def seam() -> None:
    """The per-request cost of the routing seam for a model without a policy, in process."""
    sys.path.insert(0, str(REPO))
    from mserve_worker.protocol import RequestItem  # the repo on the path
    from server.rollouts.router import Router

    class Swaps:
        def pick(self, name: str) -> None:
            return None

    class Registry:
        def __init__(self) -> None:
            self.models = {"echo": {"1.0": object()}}
            self.defaults = {"echo": "1.0"}
            self.swaps = Swaps()

        def on_change(self, what: str, listener: object) -> None:
            pass

        def get(self, name: str, version: str | None = None) -> object:
            return self.models[name][version or self.defaults[name]]

    class Model:
        name, version = "echo", "1.0"

    registry = Registry()
    router = Router(registry)  # type: ignore[arg-type]
    item = RequestItem(request_id="x", content_type="", headers=[], body=b"")
    model, n = Model(), 1_000_000
    calls = {
        "registry.get (before)": lambda: registry.get("echo", None),
        "Router.pick": lambda: router.pick("echo", None, item),
        "Router.after_enqueue": lambda: router.after_enqueue(model, item, None),  # type: ignore[arg-type]
        "(an empty call)": lambda: None,
    }
    for label, call in calls.items():
        best = min(timeit.repeat(call, number=n, repeat=5))
        print(f"{label:24s} {best / n * 1e9:7.1f} ns per call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conns", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=10.0)
    parser.add_argument("--steady", type=float, default=8.0)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--window", type=float, default=1.0)
    parser.add_argument("--min-requests", type=int, default=5)
    parser.add_argument("--seam", action="store_true")
    args = parser.parse_args()
    if args.seam:
        seam()
    else:
        run(args)


if __name__ == "__main__":
    main()
