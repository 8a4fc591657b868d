"""What shadowing 100% of a model's traffic costs its clients (issue 42's target: the client's
p50 moves by nothing measurable, <= 5 %, while the shadow has spare CPU, and never by more than
the shadow's own compute when it has none).

One model, two versions of the same CPU-bound handler (it spins ``--work-ms`` per request), one
worker each. Rows, taken in turn round by round, medians printed:

- ``spare``: the server on every core; one client connection sends requests back to back:
  without a shadow, then with ``{"version": "2.0", "share": 100}``.
- ``no spare CPU``: the server's processes pinned to one core, so the primary's worker, the
  shadow's and the frontend share it: the same two runs. The shadow's own compute per request
  (``--work-ms`` plus its share of the frontend's work) is what the client may lose at most.

Each run also reads the shadow's counts (every pair compared, none dropped at this pace) from
``GET /models/bench/shadow``.

    python scripts/bench_shadow.py [--seconds 8] [--rounds 3] [--work-ms 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import psutil
from harness import Client, Machine, Server, archive, cpu_seconds

SPIN_HANDLER = """
import json
import time

WORK_S = {work_s}


def handle(data, context):
    if data is None:
        return None
    out = []
    for row in data:
        until = time.process_time() + WORK_S
        n = 0
        while time.process_time() < until:
            n += 1
        out.append({{"predictions": [{{"label": "cat", "score": 0.5}}], "version": "same"}})
    return out
"""


def set_shadow(server: Server, on: bool) -> None:
    if on:
        body = json.dumps({"version": "2.0", "share": 100, "queue_size": 1000}).encode()
        status, answer = server.request("PUT", "/models/bench/shadow", body, api="management")
    else:
        status, answer = server.request("DELETE", "/models/bench/shadow", api="management")
        status = 200 if status == 404 else status
    assert status == 200, answer


def shadow_counts(server: Server) -> dict[str, int]:
    status, answer = server.request("GET", "/models/bench/shadow", api="management")
    return json.loads(answer)["counts"] if status == 200 else {}


def client_p50(server: Server, seconds: float) -> tuple[float, int]:
    """Back-to-back requests on one keep-alive connection: (p50 in ms, requests)."""
    client = Client(server.status["inference"], server.headers["inference"])
    body = b'{"x": 1}'
    for _ in range(20):  # warm the connection and the workers
        client.request("POST", "/predictions/bench", body)
    latencies = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        status, _ = client.request("POST", "/predictions/bench", body)
        latencies.append(time.perf_counter() - t0)
        assert status == 200
    return statistics.median(latencies) * 1000, len(latencies)


def version_pids(server: Server, version: str) -> list[int]:
    _, described = server.request("GET", f"/models/bench/{version}", api="management")
    return [w["pid"] for w in json.loads(described)[0]["workers"]]


def pin(server: Server, cpus: list[int]) -> None:
    for proc in server.processes():
        with contextlib.suppress(psutil.Error):  # a process that has just exited
            proc.cpu_affinity(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-ms", type=float, default=5.0)
    args = parser.parse_args()
    all_cpus = sorted(psutil.Process().cpu_affinity() or [0])
    with tempfile.TemporaryDirectory(prefix="bench-shadow-") as tmp:
        work = Path(tmp)
        (work / "spin.py").write_text(SPIN_HANDLER.format(work_s=args.work_ms / 1000))
        for version in ("1.0", "2.0"):
            archive(work / "store", "bench", "--handler", work / "spin.py", "--version", version)
            (work / "store" / "bench.mar").rename(work / "store" / f"bench_{version}.mar")
        server = Server(
            work, {"disable_token_authorization": True, "enable_model_api": True, "grpc": False},
            ["bench=bench_1.0.mar"],
        )  # fmt: skip
        try:
            status, answer = server.request(
                "POST", "/models?url=bench_2.0.mar&initial_workers=1&synchronous=true",
                api="management",
            )  # fmt: skip
            assert status == 200, answer
            machine = Machine()
            rows: dict[str, list[float]] = {}
            # (frontend, shadow worker) CPU ms per client request
            cpu: dict[str, list[tuple[float, float]]] = {}
            counts: dict[str, dict[str, int]] = {}
            for _ in range(args.rounds):
                for cpus_name, cpus in (("spare", all_cpus), ("no spare CPU", all_cpus[:1])):
                    pin(server, cpus)
                    for on in (False, True):
                        set_shadow(server, on)
                        shadow_worker = version_pids(server, "2.0")
                        before = cpu_seconds([server.pid]), cpu_seconds(shadow_worker)
                        p50, n = client_p50(server, args.seconds)
                        frontend_ms = (cpu_seconds([server.pid]) - before[0]) / n * 1000
                        shadow_ms = (cpu_seconds(shadow_worker) - before[1]) / n * 1000
                        key = f"{cpus_name:<13} {'100% shadow' if on else 'no shadow':<11}"
                        rows.setdefault(key, []).append(p50)
                        cpu.setdefault(key, []).append((frontend_ms, shadow_ms))
                        if on:
                            time.sleep(0.5)  # the last pairs settle
                            counts[key] = shadow_counts(server)
                            counts[key]["requests"] = n
            pin(server, all_cpus)
        finally:
            server.stop()
    print(f"bench_shadow: {len(all_cpus)} CPUs, handler {args.work_ms:g} ms of CPU per"
          f" request, {args.seconds:g} s per run, median of {args.rounds} rounds;"
          f" {machine.since()}")  # fmt: skip
    print(f"{'CPU':<13} {'shadow':<11} {'client p50 ms':>14} {'frontend CPU ms':>16}"
          f" {'shadow worker CPU ms':>21}  (per request)")  # fmt: skip
    medians = {k: statistics.median(v) for k, v in rows.items()}
    spent = {k: tuple(statistics.median(c[i] for c in v) for i in (0, 1)) for k, v in cpu.items()}
    for key, value in medians.items():
        print(f"{key} {value:14.3f} {spent[key][0]:16.3f} {spent[key][1]:21.3f}")
    for cpus_name in ("spare", "no spare CPU"):
        off_key = f"{cpus_name:<13} {'no shadow':<11}"
        on_key = f"{cpus_name:<13} {'100% shadow':<11}"
        off, on = medians[off_key], medians[on_key]
        # the shadow's own compute: its worker's CPU, and what it added to the frontend's
        own = spent[on_key][1] + spent[on_key][0] - spent[off_key][0]
        print(f"{cpus_name}: client p50 {on - off:+.3f} ms ({(on / off - 1) * 100:+.1f} %) with"
              f" 100% shadow; the shadow's own compute {own:.3f} ms per request")  # fmt: skip
    for key, c in counts.items():
        print(f"last run of '{key.strip()}': {json.dumps(c)}")


if __name__ == "__main__":
    main()
