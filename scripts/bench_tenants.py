"""Tenants and fair queuing under load (issue 45's targets), figures printed.

The MLP (examples/mlp: Linear 256-1024-1024-10), one worker, batches of 8 (5 ms delay), behind
one server with a tenants file (quiet, noisy: weight 1 each; heavy: 3, light: 1). Rows:

- ``quiet alone``: the quiet tenant sends 100 requests/s (open loop: 4 threads, each on its own
  schedule of 25/s, a late request sent at once) for ``--seconds``: its p50/p99, refusals.
- ``quiet + noisy``: the same while the noisy tenant sends as fast as wrk's 64 connections
  allow. Target: the quiet tenant's p99 <= 1.5x alone, none refused. Both rows are taken in
  turn ``--rounds`` times on the same server; each round prints its own ratio, then the p99s
  of all rounds' requests pooled and their ratio. Each mixed row also gives the CPU (% of one
  core) of the frontend, the worker, wrk and this script's quiet client, and the machine's
  busy share: what the two cores were asked for (CPU contention), beside ``batch``, the mean
  time per batch of 8 at the noisy rate, the unit of the queueing a quiet request still meets
  (the batch running, then its own). ``--fifo`` adds the same rows on a server without
  tenants (both clients send the one inference key: one FIFO queue), which is what the fair
  queue saves the quiet client from.
- ``3:1``: heavy and light, 32 wrk connections each at once: their shares of the requests the
  server served in that time, from its own counts (``mserve_tenant_requests_served_total``).
  Target: within 10 % of 0.75 / 0.25.
- ``frontend CPU``: the echo model, 16 connections, tenancy off (no tenants file) against on with
  one tenant (its key sent): the frontend's CPU per request, rounds in turn, medians. Target:
  <= 5 us more with tenancy on.

- ``--micro``: the same cost in process, steadier than CPU per request through a busy VM: a
  request's queue steps (a Job made, put, popped, answered) on the plain JobQueue against the
  tenant's steps (its key looked up, admitted) and the FairJobQueue, rounds interleaved,
  medians. Then the key check alone (``auth.check_tenant``), per request: without tenants (the
  inference key), with tenants a tenant's key, and the server's own inference key (the
  ``default`` tenant), beside a sha256 of the key (what a key not yet cached costs).
- ``--callgrind N``: the frontend's user-space instructions per echo request under valgrind's
  callgrind (the same whatever the machine's load), tenancy off against on with one tenant
  (its key sent), N requests over 16 connections each: the figure the CPU target is read
  from on a loaded VM. Minutes (Python runs ~50x slower under valgrind).

    python scripts/bench_tenants.py [--seconds 10] [--rounds 3] [--fifo] [--micro]
    python scripts/bench_tenants.py --callgrind 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from bench_ceiling import callgrind_rows
from harness import Client, Machine, Server, build_archives, cpu_seconds, wrk_load

from mserve_worker.protocol import RequestItem
from server import tenants as server_tenants
from server.auth import Keys, check_tenant
from server.models.batching import Job, JobQueue
from server.models.fair import FairJobQueue
from server.tenants import Tenants, key_hash

MLP_BODY = json.dumps({"data": [0.01 * i for i in range(256)]}).encode()
KEYS = {name: f"bench-key-{name}-0123456789" for name in ("quiet", "noisy", "heavy", "light")}


def tenants_file(path: Path, names: tuple[str, ...], weights: dict[str, int]) -> Path:
    lines = ["tenants:"]
    for name in names:
        lines += [f"  {name}:", f"    keys: [sha256:{key_hash(KEYS[name])}]",
                  f"    weight: {weights.get(name, 1)}"]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


class As:
    """The server, seen by a client that sends ``key``: what wrk_load drives."""

    def __init__(self, server: Server, key: str) -> None:
        self.host, self.port = server.host, server.port
        self.headers = {"inference": {"Authorization": f"Bearer {key}"}}


def paced(server: Server, key: str, rate: float, seconds: float) -> dict[str, Any]:
    """``rate`` requests/s from 4 threads on their own schedules: p50, p99 (ms), refused,
    the latencies (s)."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    client = Client(server.status["inference"], headers)
    latencies: list[float] = []
    refused = [0]
    lock = threading.Lock()
    threads_n = 4
    period = threads_n / rate
    for _ in range(10):
        client.request("POST", "/predictions/mlp", MLP_BODY)
    start = time.perf_counter() + 0.05

    def run(i: int) -> None:
        mine = []
        n = 0
        due = start + i * period / threads_n
        while due < start + seconds:
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            t0 = time.perf_counter()
            status, _ = client.request("POST", "/predictions/mlp", MLP_BODY)
            mine.append(time.perf_counter() - t0)
            if status != 200:
                with lock:
                    refused[0] += 1
            n += 1
            due += period
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    latencies.sort()
    return {"p50": latencies[len(latencies) // 2] * 1000, "p99": _p99(latencies),
            "n": float(len(latencies)), "refused": float(refused[0]),
            "latencies": latencies}  # fmt: skip


def served(server: Server) -> dict[str, float]:
    _, text = server.request("GET", "/metrics", api="metrics")
    found: dict[str, float] = {}
    pattern = r'^mserve_tenant_requests_served_total\{model="mlp",tenant="([^"]+)"\} (\S+)$'
    for m in re.finditer(pattern, text.decode(), re.M):
        found[m.group(1)] = float(m.group(2))
    return found


def register_mlp(server: Server) -> None:
    status, answer = server.request(
        "POST", "/models?url=mlp.mar&batch_size=8&max_batch_delay=5&initial_workers=1"
        "&synchronous=true", api="management",
    )  # fmt: skip
    assert status == 200, answer


def quiet_rows(server: Server, quiet: str, noisy: str, seconds: float, rounds: int,
               label: str) -> None:  # fmt: skip
    """``rounds`` times in turn: the quiet tenant alone, then beside the noisy one; printed."""
    pooled: dict[str, list[float]] = {"alone": [], "mixed": []}
    workers = server.worker_pids("mlp")
    for r in range(rounds):
        alone = paced(server, quiet, 100, seconds)
        box: dict[str, Any] = {}
        noise = threading.Thread(target=_noise, args=(server, noisy, int(seconds) + 2, box))
        wrk_before = _children_cpu_s()
        noise.start()
        time.sleep(1.0)  # the noisy queue fills first
        machine = Machine()
        before = _cpu_now(server.pid, workers)
        mixed = paced(server, quiet, 100, seconds)
        after = _cpu_now(server.pid, workers)
        busy = machine.since()
        noise.join()
        wall_s = after[3] - before[3]
        front, worker, client = (
            (b - a) / wall_s * 100 for a, b in zip(before[:3], after[:3], strict=True)
        )
        wrk = (_children_cpu_s() - wrk_before) / (seconds + 2) * 100
        for row, got in (("alone", alone), ("mixed", mixed)):
            pooled[row] += got["latencies"]
        rps = box.get("rps", 0.0)
        print(f"{label} round {r + 1}: quiet alone p50 {alone['p50']:5.1f} p99 {alone['p99']:5.1f}"
              f" ms | beside noisy p50 {mixed['p50']:5.1f} p99 {mixed['p99']:6.1f} ms, ratio"
              f" {mixed['p99'] / alone['p99']:.2f}, refused {alone['refused'] + mixed['refused']:.0f}"  # noqa: E501
              f" | noisy {rps:.0f} req/s (p99 {box.get('p99', 0):.0f} ms), batch"
              f" {8000 / max(rps + 100, 1):.1f} ms | cpu % front {front:.0f} worker {worker:.0f}"
              f" wrk {wrk:.0f} client {client:.0f} | {busy}", flush=True)  # fmt: skip
    a, m = _p99(pooled["alone"]), _p99(pooled["mixed"])
    print(f"{label} pooled over {rounds} round(s): quiet p99 alone {a:.1f} ms, beside the noisy"
          f" tenant {m:.1f} ms: ratio {m / a:.2f} (target <= 1.5)", flush=True)  # fmt: skip


def _noise(server: Server, key: str, seconds: int, box: dict[str, Any]) -> None:
    box.update(wrk_load(As(server, key), "/predictions/mlp", MLP_BODY, 64, seconds))


def _cpu_now(frontend: int, workers: list[int]) -> tuple[float, float, float, float]:
    """CPU seconds so far of the frontend, the workers, this script; the time."""
    return cpu_seconds([frontend]), cpu_seconds(workers), _own_cpu_s(), time.perf_counter()


def _p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[int(len(ordered) * 0.99)] * 1000


def _own_cpu_s() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


def _children_cpu_s() -> float:
    """CPU of this script's children that have ended and been waited for (wrk runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def shares(server: Server, seconds: int) -> tuple[float, float, float]:
    box: dict[str, Any] = {}
    runs = [
        threading.Thread(target=lambda n=name: box.update({n: wrk_load(
            As(server, KEYS[n]), "/predictions/mlp", MLP_BODY, 32, seconds + 2)}))
        for name in ("heavy", "light")
    ]  # fmt: skip
    for t in runs:
        t.start()
    time.sleep(1.0)
    before = served(server)
    time.sleep(seconds)
    after = served(server)
    for t in runs:
        t.join()
    heavy = after.get("heavy", 0) - before.get("heavy", 0)
    light = after.get("light", 0) - before.get("light", 0)
    return heavy / (heavy + light), heavy, light


def frontend_us(server: Server, key: str, seconds: int) -> float:
    before = cpu_seconds([server.pid])
    r = wrk_load(As(server, key), "/predictions/echo", b'{"x": 1}', 16, seconds)
    return (cpu_seconds([server.pid]) - before) / (r["rps"] * seconds) * 1e6


async def micro_rows(work: Path, rounds: int, n: int = 100_000) -> None:
    tenants = Tenants(tenants_file(work / "micro.yaml", ("quiet",), {}), lambda: ["m"])
    item = RequestItem(request_id="r", content_type="", headers=[], body=b"")
    key = KEYS["quiet"]

    async def per_request_us(fair: bool) -> float:
        queue = FairJobQueue(n + 1) if fair else JobQueue(n + 1)
        started = time.perf_counter()
        for _ in range(n):
            job = Job(item, queue.new_future())
            if fair:
                tenant = tenants.of_key(key)
                assert tenant is not None
                tenant.admit("m", job.future)
                job.tenant = tenant
            queue.put(job)
            popped = queue.pop()
            assert popped is not None
            popped.future.set_result(None)
        await asyncio.sleep(0)
        return (time.perf_counter() - started) / n * 1e6

    rows: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for fair in (False, True):
            rows[fair].append(await per_request_us(fair))
    off, on = statistics.median(rows[False]), statistics.median(rows[True])
    print(f"micro  queue steps per request: plain {off:.2f} us, tenant + fair queue {on:.2f} us:"
          f" {on - off:+.2f} us (target <= +5)")  # fmt: skip
    key_rows(tenants, rounds)


def key_rows(with_tenants: Tenants, rounds: int, n: int = 200_000) -> None:
    """The key check per request (``auth.check_tenant``), tenants off and on, rounds
    interleaved, medians."""
    own = KEYS["heavy"]  # the server's own inference key: in no tenant of the file
    keys = Keys(Path("unused.json"), {}, fixed={"inference": own, "management": own + "-m"})

    def per_check_us(current: Tenants | None, key: str) -> float:
        server_tenants.current = current
        started = time.perf_counter()
        for _ in range(n):
            check_tenant(keys, "inference", key, "bench")
        return (time.perf_counter() - started) / n * 1e6

    def sha_us() -> float:
        started = time.perf_counter()
        for _ in range(n):
            key_hash(own)
        return (time.perf_counter() - started) / n * 1e6

    cases = {"no tenants": (None, own), "a tenant's key": (with_tenants, KEYS["quiet"]),
             "the server's own key": (with_tenants, own)}  # fmt: skip
    rows: dict[str, list[float]] = {name: [] for name in [*cases, "sha256"]}
    try:
        for _ in range(rounds):
            for name, (current, key) in cases.items():
                rows[name].append(per_check_us(current, key))
            rows["sha256"].append(sha_us())
    finally:
        server_tenants.current = None
    print("micro  key check per request: " + ", ".join(
        f"{name} {statistics.median(values):.3f} us" for name, values in rows.items()))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fifo", action="store_true")
    parser.add_argument("--micro", action="store_true", help="only the in-process cost")
    parser.add_argument("--callgrind", type=int, default=0, metavar="N",
                        help="only the frontend's instructions per request")  # fmt: skip
    parser.add_argument("--skip", default="", help="rows to leave out: quiet,shares,cpu")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    machine = Machine()
    with tempfile.TemporaryDirectory(prefix="bench-tenants-") as tmp:
        work = Path(tmp)
        if args.micro:
            asyncio.run(micro_rows(work, max(args.rounds, 5)))
            print(f"machine: {machine.since()}")
            return
        if args.callgrind:
            build_archives(work, with_mlp=False)
            one = tenants_file(work / "one.yaml", ("quiet",), {})
            off = callgrind_rows(work, b'{"x": 1}', args.callgrind, "grpc: false\n", "off",
                                 bare=False)  # fmt: skip
            on = callgrind_rows(work, b'{"x": 1}', args.callgrind,
                                f"grpc: false\ntenants_file: {json.dumps(str(one))}\n",
                                "on (one tenant)", bare=False, key=KEYS["quiet"])  # fmt: skip
            print(f"callgrind frontend per request: on - off = {on - off:+,.0f} instructions"
                  f" ({(on - off) / off * 100:+.1f} %)")  # fmt: skip
            print(f"machine: {machine.since()}")
            return
        build_archives(work, with_mlp=True)
        path = tenants_file(work / "tenants.yaml", ("quiet", "noisy", "heavy", "light"),
                            {"heavy": 3})  # fmt: skip
        server = Server(work, {"enable_model_api": True, "grpc": False, "tenants_file": str(path)},
                        name="tenants")  # fmt: skip
        try:
            register_mlp(server)
            if "quiet" not in skip:
                quiet_rows(server, KEYS["quiet"], KEYS["noisy"], args.seconds, args.rounds, "fair")
            if "shares" not in skip:
                share, heavy, light = shares(server, int(args.seconds))
                print(f"3:1    heavy {heavy:.0f}, light {light:.0f} served: heavy's share"
                      f" {share:.3f} (target 0.75 +- 10 %: 0.675-0.825)")  # fmt: skip
        finally:
            server.stop()
        if args.fifo and "quiet" not in skip:
            plain = Server(work, {"enable_model_api": True, "grpc": False}, name="fifo")
            try:
                register_mlp(plain)
                key = plain.keys["inference"]
                quiet_rows(plain, key, key, args.seconds, args.rounds, "fifo")
            finally:
                plain.stop()
        if "cpu" not in skip:
            one = tenants_file(work / "one.yaml", ("quiet",), {})
            off = Server(work, {"grpc": False}, ["echo=echo.mar"], name="off")
            on = Server(work, {"grpc": False, "tenants_file": str(one)}, ["echo=echo.mar"],
                        name="on")  # fmt: skip
            try:
                rows: dict[str, list[float]] = {"off": [], "on": []}
                for _ in range(args.rounds):
                    rows["off"].append(frontend_us(off, off.keys["inference"], int(args.seconds)))
                    rows["on"].append(frontend_us(on, KEYS["quiet"], int(args.seconds)))
                off_us, on_us = statistics.median(rows["off"]), statistics.median(rows["on"])
                print(f"cpu    frontend per request: off {off_us:.1f} us, on (one tenant)"
                      f" {on_us:.1f} us: {on_us - off_us:+.1f} us (target <= +5);"
                      f" rounds off {[round(x, 1) for x in rows['off']]}"
                      f" on {[round(x, 1) for x in rows['on']]}")  # fmt: skip
            finally:
                off.stop()
                on.stop()
    print(f"machine: {machine.since()}")


if __name__ == "__main__":
    main()
