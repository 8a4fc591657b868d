"""Many models on one server: 500 small archives under a memory budget, Zipf-like traffic.

Builds ``--models`` archives of a tiny torch model each (a Linear layer with its own weights,
fixed seed) with the archiver library, and:

1. **probe**: a server without a budget loads ``--fit`` of them; the sum of its workers' PSS is
   the budget that fits about that many loaded workers (or give ``--budget-mb``).
2. **density**: a server with ``worker_memory_budget_mb`` set to it registers every archive
   with no worker (loaded on demand) and ``--clients`` threads ask for models drawn from a
   Zipf-like law (``--zipf`` exponent, a fixed random order of the models) for ``--duration``
   seconds. A reply says when its worker loaded the model: a request sent before that waited
   for a load (cold), any other is a warm hit. Printed: requests, errors, hit ratio, p50/p99 of
   warm hits and of cold loads, loads and evictions per second (the server's counters), the
   workers' peak PSS against the budget (sampled every ``--sample-s``).
3. **warm comparison**: sequential requests to a loaded model of the density server and to a
   server that has only that model, in alternating rounds (median of the rounds' p50s).
4. ``--torchserve N`` (when TorchServe is installed in ``--torchserve-venv``): N of the same
   archives with one worker each on TorchServe and on mserve, registration time and the memory
   of the whole server (frontend, templates, workers: PSS and RSS).

Install TorchServe apart from the project (never into .venv), for example::

    python -m venv .cache/torchserve
    .cache/torchserve/bin/pip install torchserve==0.12.0 torch==2.13.0 pyyaml numpy

(TorchServe's worker imports yaml; without it every worker fails to start. Pin torch==2.13.0:
a bare ``torch`` pulls a CUDA build of several GB.)

The machine's load average and CPU steal during each phase are printed with its figures:
compare runs only at similar steal.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
from harness import REPO, Client, Machine, Server, free_port, wait_until

MIB = 2**20
IN_FEATURES, OUT_FEATURES = 32, 8
SEED = 1234

HANDLER = f'''"""A tiny Linear model; answers its outputs and when this worker loaded the model."""
import json
import os
import time

import torch

_model = None
_loaded_at = None


def _initialize(context):
    global _model, _loaded_at
    weights = os.path.join(
        context.system_properties["model_dir"], context.manifest["model"]["serializedFile"]
    )
    torch.set_num_threads(1)
    model = torch.nn.Linear({IN_FEATURES}, {OUT_FEATURES})
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    _model = model.eval()
    _loaded_at = time.time()


def handle(data, context):
    if _model is None:
        _initialize(context)
    if not data:
        return None
    rows = []
    for item in data:
        body = item.get("body") if item.get("body") is not None else item.get("data")
        if isinstance(body, (bytes, bytearray)):
            body = json.loads(body)
        rows.append(body["data"])
    with torch.no_grad():
        out = _model(torch.tensor(rows, dtype=torch.float32)).tolist()
    return [{{"y": row, "loaded_at": _loaded_at, "pid": os.getpid()}} for row in out]
'''
BODY = json.dumps({"data": [0.5] * IN_FEATURES}).encode()


# --- archives ------------------------------------------------------------------------------


def build_archives(work: Path, count: int) -> Path:
    """``count`` archives m000.mar ..., each with its own weights (seeded), built with the
    archiver library as ``model-archiver`` would."""
    import torch

    from archiver.cli import build

    store = work / "store"
    store.mkdir(parents=True, exist_ok=True)
    handler = work / "density_handler.py"
    handler.write_text(HANDLER)
    weights = work / "weights"
    weights.mkdir(exist_ok=True)
    started = time.perf_counter()
    for i in range(count):
        torch.manual_seed(SEED + i)
        path = weights / f"m{i:03d}.pt"
        torch.save(torch.nn.Linear(IN_FEATURES, OUT_FEATURES).state_dict(), path)
        build(
            model_name=f"m{i:03d}", handler=f"{handler}:handle", version="1.0",
            serialized_file=str(path), model_file=None, extra_files=(),
            requirements_file=None, config_file=None, export_path=str(store),
            archive_format="default", runtime="python", force=True, model_path=None,
        )  # fmt: skip
    print(f"built {count} archives in {time.perf_counter() - started:.1f} s ({store})")
    return store


# --- servers -------------------------------------------------------------------------------


class Mserve(Server):
    """A server of this benchmark: the model API on, one keep-alive client per API."""

    def __init__(self, work: Path, name: str, settings: dict[str, Any]) -> None:
        super().__init__(work, {"enable_model_api": True, **settings}, name=name)
        self.inference = Client(self.status["inference"], self.headers["inference"])
        self.management = Client(self.status["management"], self.headers["management"])
        self.metrics = Client(self.status["metrics"], {})

    def register(self, name: str, workers: int) -> None:
        sync = "&synchronous=true" if workers else ""
        status, body = self.management.request(
            "POST", f"/models?url={name}.mar&model_name={name}&initial_workers={workers}{sync}"
        )
        if status != 200:
            raise SystemExit(f"registering {name}: {status} {body[:300]!r}")

    def predict(self, name: str) -> tuple[int, dict[str, Any] | bytes]:
        status, body = self.inference.request("POST", f"/predictions/{name}", BODY)
        return status, (json.loads(body) if status == 200 else body)

    def counter(self, metric: str) -> float:
        """The sum of a Prometheus counter over its labels."""
        _status, body = self.metrics.request("GET", "/metrics")
        pattern = re.compile(rf"^{metric}(?:{{[^}}]*}})? (\S+)$", re.M)
        return sum(float(v) for v in pattern.findall(body.decode()))

    def template_ready(self) -> bool:
        log = (self.run_dir / "logs" / "mserve.log").read_text(errors="replace")
        return "worker template for" in log and "ready (pid" in log


# --- memory --------------------------------------------------------------------------------


def _processes(root: int) -> list[psutil.Process]:
    try:
        proc = psutil.Process(root)
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def is_worker(proc: psutil.Process) -> bool:
    """A worker titles itself ``mserve-worker <model>`` (the template does not)."""
    try:
        return " ".join(proc.cmdline()).startswith("mserve-worker ")
    except psutil.Error:
        return False


def memory(procs: list[psutil.Process]) -> tuple[int, int]:
    """PSS and RSS summed over ``procs`` (gone ones left out)."""
    pss = rss = 0
    for proc in procs:
        try:
            info = proc.memory_full_info()
        except psutil.Error:
            continue
        pss += info.pss
        rss += info.rss
    return pss, rss


class Sampler:
    """The workers' PSS (and the whole server's) every ``every_s``, in a thread."""

    def __init__(self, root: int, every_s: float) -> None:
        self.root, self.every_s = root, every_s
        self.peak_workers = self.peak_total = self.peak_count = 0
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            procs = _processes(self.root)
            workers = [p for p in procs if is_worker(p)]
            worker_pss, _ = memory(workers)
            total_pss, _ = memory(procs)
            self.samples.append(worker_pss)
            self.peak_workers = max(self.peak_workers, worker_pss)
            self.peak_total = max(self.peak_total, total_pss)
            self.peak_count = max(self.peak_count, len(workers))

    @contextmanager
    def running(self) -> Iterator[Sampler]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()


# --- phases --------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def warm_up(server: Mserve, name: str) -> None:
    """Load one model and wait for the worker template: later loads fork from it. That first
    worker was started with exec while the template warmed (a whole interpreter importing
    torch, 5-6x a forked worker's PSS): unload it, so that every worker measured is forked."""
    status, body = server.predict(name)
    if status != 200:
        raise SystemExit(f"warm-up request to {name}: {status} {body!r}")
    wait_until(server.template_ready, 120, "the worker template")
    status, body = server.management.request(
        "PUT", f"/models/{name}?min_worker=0&max_worker=1&synchronous=true"
    )
    if status != 200:
        raise SystemExit(f"unloading {name}: {status} {body!r}")


def probe_budget(work: Path, fit: int) -> float:
    """Load ``fit`` models on a server without a budget: their workers' PSS, in MiB."""
    server = Mserve(work, "probe", {})
    try:
        for i in range(fit):
            server.register(f"m{i:03d}", 0)
        warm_up(server, "m000")
        for i in range(fit):
            status, body = server.predict(f"m{i:03d}")
            if status != 200:
                raise SystemExit(f"probe request to m{i:03d}: {status} {body!r}")
        workers = [p for p in _processes(server.pid) if is_worker(p)]
        pss, rss = memory(workers)
        print(f"probe: {len(workers)} loaded workers use {pss / MIB:.0f} MiB PSS"
              f" ({pss / len(workers) / MIB:.1f} MiB each; RSS {rss / len(workers) / MIB:.0f} MiB"
              " each)")  # fmt: skip
        return pss / MIB
    finally:
        server.stop()


def zipf_weights(count: int, exponent: float) -> list[float]:
    return [1.0 / (rank + 1) ** exponent for rank in range(count)]


def density(args: argparse.Namespace, work: Path, budget_mb: int) -> tuple[Mserve, str]:
    machine = Machine()
    server = Mserve(work, "density", {"worker_memory_budget_mb": budget_mb, "load_wait_s": 60})
    names = [f"m{i:03d}" for i in range(args.models)]
    started = time.perf_counter()
    with _threads(4) as pool:
        list(pool.map(lambda n: server.register(n, 0), names))
    registered_s = time.perf_counter() - started
    print(f"density: registered {len(names)} models (no worker) in {registered_s:.1f} s;"
          f" budget {budget_mb} MiB; {machine.since()}")  # fmt: skip
    order = names[:]
    random.Random(SEED).shuffle(order)  # which model is hot: a fixed random order
    weights = zipf_weights(len(order), args.zipf)
    warm_up(server, order[0])

    loads0 = server.counter("mserve_model_loads_total")
    evictions0 = server.counter("mserve_model_evictions_total")
    results: list[tuple[bool, float, int]] = []  # (cold, seconds, status)
    lock = threading.Lock()
    deadline = time.monotonic() + args.duration

    def client(seed: int) -> None:
        rng = random.Random(seed)
        mine = []
        while time.monotonic() < deadline:
            name = rng.choices(order, weights)[0]
            sent = time.time()
            t0 = time.perf_counter()
            try:
                status, body = server.predict(name)
            except (OSError, http.client.HTTPException):
                status, body = 0, b""
            seconds = time.perf_counter() - t0
            cold = status == 200 and isinstance(body, dict) and body["loaded_at"] >= sent
            mine.append((cold, seconds, status))
        with lock:
            results.extend(mine)

    machine.since()
    sampler = Sampler(server.pid, args.sample_s)
    run_started = time.monotonic()
    with sampler.running():
        threads = [threading.Thread(target=client, args=(SEED + i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elapsed = time.monotonic() - run_started
    during = machine.since()
    loads = server.counter("mserve_model_loads_total") - loads0
    evictions = server.counter("mserve_model_evictions_total") - evictions0
    warm = [s for cold, s, status in results if status == 200 and not cold]
    cold = [s for c, s, status in results if status == 200 and c]
    errors = [status for _c, _s, status in results if status != 200]
    print(f"density run: {args.clients} clients, Zipf s={args.zipf} over {len(order)} models,"
          f" {elapsed:.0f} s; {during}")  # fmt: skip
    print(f"  requests {len(results)}  errors {len(errors)}"
          + (f" (statuses {sorted(set(errors))})" if errors else "")
          + f"  hit ratio {len(warm) / max(1, len(warm) + len(cold)):.3f}")  # fmt: skip
    print(f"  warm hits  {len(warm):>6}  p50 {pct(warm, 50) * 1000:7.1f} ms"
          f"  p99 {pct(warm, 99) * 1000:7.1f} ms")  # fmt: skip
    print(f"  cold loads {len(cold):>6}  p50 {pct(cold, 50) * 1000:7.1f} ms"
          f"  p99 {pct(cold, 99) * 1000:7.1f} ms  (target: p50 <= 300 ms)")  # fmt: skip
    print(f"  loads {loads / elapsed:.2f}/s  evictions {evictions / elapsed:.2f}/s"
          f"  ({loads:.0f} loads, {evictions:.0f} evictions)")  # fmt: skip
    budget = budget_mb * MIB
    print(f"  workers' PSS: peak {sampler.peak_workers / MIB:.0f} MiB = "
          f"{sampler.peak_workers / budget * 100:.0f}% of the {budget_mb} MiB budget"
          f" (target <= 110%), median {statistics.median(sampler.samples or [0]) / MIB:.0f} MiB;"
          f" at most {sampler.peak_count} workers; whole server (frontend + template + workers)"
          f" peak {sampler.peak_total / MIB:.0f} MiB PSS")  # fmt: skip
    cold_sequential(args, server, order)
    return server, order[0]


def timed(server: Mserve, name: str) -> float:
    t0 = time.perf_counter()
    status, body = server.predict(name)
    seconds = time.perf_counter() - t0
    if status != 200:
        raise SystemExit(f"request to {name}: {status} {body!r}")
    return seconds


def cold_sequential(args: argparse.Namespace, server: Mserve, order: list[str]) -> None:
    """Cold loads one at a time, the budget full (each evicts): the load itself, without the
    queueing behind other clients' loads that the mixed run adds."""
    machine = Machine()
    unloaded = [n for n in reversed(order) if _load_state(server, n) == "unloaded"]
    times = [timed(server, name) for name in unloaded[: args.cold_requests]]
    print(f"cold load, sequential, budget full: {len(times)} requests, p50"
          f" {pct(times, 50) * 1000:.0f} ms, p99 {pct(times, 99) * 1000:.0f} ms"
          f" (target: p50 <= 300 ms); {machine.since()}")  # fmt: skip


def _load_state(server: Mserve, name: str) -> str:
    _status, body = server.management.request("GET", f"/models/{name}")
    return str(json.loads(body)[0]["loadState"])


def warm_comparison(args: argparse.Namespace, work: Path, dense: Mserve, name: str) -> None:
    """The same model, warm, on the 500-model server and on a server that has only it, one
    request to each in turn, so that both see the same machine load."""
    solo = Mserve(work, "solo", {})
    try:
        solo.register(name, 1)
        machine = Machine()
        dense_p50, solo_p50 = [], []
        for server in (dense, solo) * 10:  # connections up, model loaded
            timed(server, name)
        for _ in range(args.rounds):
            pairs = [(timed(dense, name), timed(solo, name)) for _ in range(args.warm_requests)]
            dense_p50.append(statistics.median(d for d, _s in pairs))
            solo_p50.append(statistics.median(s for _d, s in pairs))
        d, s = statistics.median(dense_p50), statistics.median(solo_p50)
        print(f"warm hit, sequential, alternating, {args.rounds} rounds x {args.warm_requests}:"
              f" {args.models}-model server p50 {d * 1000:.2f} ms, one-model server"
              f" {s * 1000:.2f} ms: {(d / s - 1) * 100:+.1f}% (target within 10%);"
              f" {machine.since()}")  # fmt: skip
        print(f"  rounds' p50 (ms): {[round(x * 1000, 2) for x in dense_p50]} vs"
              f" {[round(x * 1000, 2) for x in solo_p50]}")  # fmt: skip
    finally:
        solo.stop()


# --- TorchServe ----------------------------------------------------------------------------


def compare_torchserve(args: argparse.Namespace, work: Path) -> None:
    """N archives with one worker each: TorchServe 0.12 beside mserve."""
    venv = Path(args.torchserve_venv)
    torchserve = venv / "bin" / "torchserve"
    if not torchserve.exists():
        print(f"torchserve: not installed in {venv} (see this script's docstring); skipped")
        return
    names = [f"m{i:03d}" for i in range(args.torchserve)]

    machine = Machine()
    ours = Mserve(work, "fifty", {})
    try:
        started = time.perf_counter()
        for name in names:
            ours.register(name, 1)
        reg_s = time.perf_counter() - started
        for name in names:
            assert ours.predict(name)[0] == 200
        pss, rss = memory(_processes(ours.pid))
        count = sum(map(is_worker, _processes(ours.pid)))
        print(f"mserve, {len(names)} models x 1 worker ({count} workers): registered in"
              f" {reg_s:.1f} s; whole server PSS {pss / MIB:.0f} MiB, RSS {rss / MIB:.0f} MiB;"
              f" {machine.since()}")  # fmt: skip
    finally:
        ours.stop()

    ports = {k: free_port() for k in ("inference", "management", "metrics")}
    home = work / "torchserve"
    home.mkdir(exist_ok=True)
    config = home / "config.properties"
    config.write_text(
        f"inference_address=http://127.0.0.1:{ports['inference']}\n"
        f"management_address=http://127.0.0.1:{ports['management']}\n"
        f"metrics_address=http://127.0.0.1:{ports['metrics']}\n"
        "disable_token_authorization=true\nenable_model_api=true\n"
        "default_workers_per_model=1\ninstall_py_dep_per_model=false\n"
        f"model_store={work / 'store'}\n"
    )
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "LOG_LOCATION": str(home),
           "METRICS_LOCATION": str(home), "TEMP": str(home)}  # fmt: skip
    machine.since()
    with open(home / "out.log", "wb") as out:
        proc = subprocess.Popen(
            [str(torchserve), "--start", "--foreground", "--ncs", "--disable-token-auth",
             "--model-store", str(work / "store"), "--ts-config", str(config)],
            cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    management = Client(f"127.0.0.1:{ports['management']}", {})
    inference = Client(f"127.0.0.1:{ports['inference']}", {"Content-Type": "application/json"})
    try:

        def pinged() -> bool:
            try:
                return inference.request("GET", "/ping")[0] == 200
            except OSError:
                return False

        wait_until(pinged, 120, "TorchServe to answer /ping")
        started = time.perf_counter()
        for name in names:
            status, body = management.request(
                "POST", f"/models?url={name}.mar&initial_workers=1&synchronous=true"
            )
            if status != 200:
                raise SystemExit(f"TorchServe registering {name}: {status} {body[:300]!r}")
        reg_s = time.perf_counter() - started
        for name in names:
            status, body = inference.request("POST", f"/predictions/{name}", BODY)
            if status != 200:
                raise SystemExit(f"TorchServe predicting {name}: {status} {body[:300]!r}")
        procs = _processes(proc.pid)
        pss, rss = memory(procs)
        workers = sum("model_service_worker" in " ".join(_cmdline(p)) for p in procs)
        print(f"TorchServe 0.12, {len(names)} models x 1 worker ({workers} workers): registered"
              f" in {reg_s:.1f} s; launcher + frontend (JVM) + workers PSS"
              f" {pss / MIB:.0f} MiB, RSS {rss / MIB:.0f} MiB; {machine.since()}")  # fmt: skip
    finally:
        subprocess.run([str(torchserve), "--stop"], env=env, cwd=home, capture_output=True,
                       timeout=120)  # fmt: skip
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            for p in reversed(_processes(proc.pid)):
                p.kill()


@contextmanager
def _threads(n: int) -> Iterator[Any]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as pool:
        yield pool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=500)
    parser.add_argument("--fit", type=int, default=30, help="loaded workers the budget fits")
    parser.add_argument("--budget-mb", type=int, help="skip the probe; use this budget")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent")
    parser.add_argument("--sample-s", type=float, default=0.5, help="memory sampling period")
    parser.add_argument("--rounds", type=int, default=3, help="warm comparison rounds")
    parser.add_argument("--warm-requests", type=int, default=300)
    parser.add_argument("--cold-requests", type=int, default=40)
    parser.add_argument(
        "--torchserve",
        type=int,
        default=0,
        metavar="N",
        help="also compare N archives x 1 worker with TorchServe",
    )
    parser.add_argument("--torchserve-venv", default=str(REPO / ".cache" / "torchserve"))
    parser.add_argument("--work", help="folder for archives and run dirs (default: a temp dir)")
    parser.add_argument("--skip-density", action="store_true")
    args = parser.parse_args()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-density-"))
    print(f"mserve density benchmark: {os.cpu_count()} CPUs,"
          f" {psutil.virtual_memory().total / 2**30:.0f} GiB; work dir {work}")  # fmt: skip
    try:
        build_archives(work, max(args.models, args.torchserve))
        if not args.skip_density:
            budget = args.budget_mb or int(probe_budget(work, args.fit) + 0.5)
            dense, hot = density(args, work, budget)
            try:
                warm_comparison(args, work, dense, hot)
            finally:
                dense.stop()
        if args.torchserve:
            compare_torchserve(args, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
