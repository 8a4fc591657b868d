"""What the benchmarks in scripts/ share: a real mserve started on free loopback ports and
stopped with all its processes, the load generators, CPU and steal accounting, medians.

Every benchmark runs on a shared VM whose speed drifts: the CPU a process spent per request and
the hypervisor's steal during a run (``cpu_split``, ``Machine``) tell a slow row from a starved
one, and the scripts take their rows in turn, round by round, then print the medians.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import psutil

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
START_TIMEOUT_S = 600  # a start that also builds a model's environment or warms torch


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


# A benchmark killed with SIGTERM (``timeout 600 python scripts/bench_...``, a CI job's end) ends
# as on Ctrl-C: its finally blocks run and stop the servers and workers it started, which would
# otherwise live on and skew every later run.
signal.signal(signal.SIGTERM, _stop_on_sigterm)


def run(cmd: list[Any], **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; a failure ends the benchmark with its command line and output."""
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if out.returncode != 0:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{out.stdout}\n{out.stderr}")
    return out


def archive(store: Path, name: str, *args: Any) -> None:
    """``model-archiver --model-name name ARGS --export-path store`` (the store made if new)."""
    store.mkdir(parents=True, exist_ok=True)
    run([BIN / "model-archiver", "--model-name", name, *args, "--export-path", store])


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def free_port(ports: Iterable[int] | None = None) -> int:
    """A free loopback port: the kernel's choice, or the first of ``ports`` that binds."""
    for port in ports if ports is not None else (0,):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise SystemExit("no free port")


ECHO_HANDLER = """
def handle(data, context):
    if not data:
        return None
    return [row.get("body") for row in data]
"""


def build_archives(work: Path, with_mlp: bool) -> None:
    """echo.mar and (``with_mlp``) mlp.mar in ``<work>/store``: the models bench_server.py and
    bench_ray.py serve. The MLP is examples/mlp (its weights: seed 0)."""
    (work / "echo.py").write_text(ECHO_HANDLER)
    archive(work / "store", "echo", "--handler", work / "echo.py")
    if with_mlp:
        mlp = REPO / "examples" / "mlp"
        run([sys.executable, mlp / "make_weights.py", work / "mlp.pt"])
        archive(work / "store", "mlp", "--handler", f"{mlp / 'handler.py'}:handle",
                "--model-file", mlp / "model.py", "--serialized-file", work / "mlp.pt")  # fmt: skip


# --- the server ----------------------------------------------------------------------------


class Target(Protocol):
    """What the load generators drive: mserve, or a bare server in the same shape."""

    host: str
    port: int
    headers: dict[str, dict[str, str]]


class Server:
    """A real ``mserve --start`` (daemon) with every listener on a free loopback port.

    ``settings`` go over the defaults into ``<work>/mserve[-name].yaml``; ``models`` are
    ``--models`` arguments. ``keys[api]`` and ``headers[api]``: what a client sends (the keys read
    from the run dir's key_file.json, as a client reads them, while token authorization is on)."""

    def __init__(
        self, work: Path, settings: dict[str, Any] | None = None, models: Iterable[str] = (),
        name: str = "",
    ) -> None:  # fmt: skip
        suffix = f"-{name}" if name else ""
        self.run_dir = work / f"run{suffix}"
        config = work / f"mserve{suffix}.yaml"
        settings = settings or {}
        apis = ["inference", "management", "metrics"]
        if settings.get("grpc", True):
            apis += ["grpc_inference", "grpc_management"]
        lines = {
            **{f"{api}_address": "127.0.0.1:0" for api in apis},
            "model_store": str(work / "store"),
            **settings,
        }
        config.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in lines.items()))
        models = list(models)
        started = time.perf_counter()
        run([BIN / "mserve", "--start", "--config", config, "--run-dir", self.run_dir,
             *(["--models", *models] if models else [])], timeout=START_TIMEOUT_S)  # fmt: skip
        self.ready_s = time.perf_counter() - started
        self.status: dict[str, Any] = json.loads((self.run_dir / "status.json").read_text())
        self.pid = int(self.status["pid"])
        key_file = self.run_dir / "key_file.json"
        found = json.loads(key_file.read_text()) if key_file.exists() else {}
        self.keys: dict[str, str] = {
            api: entry["key"] for api, entry in found.items() if isinstance(entry, dict)
        }
        self.headers = {
            api: {"Content-Type": "application/json"}
            | ({"Authorization": f"Bearer {self.keys[api]}"} if api in self.keys else {})
            for api in ("inference", "management", "metrics")
        }
        self.host, port = self.status["inference"].rsplit(":", 1)
        self.port = int(port)

    def request(
        self, method: str, path: str, body: bytes = b"", api: str = "inference"
    ) -> tuple[int, bytes]:
        """One request on a connection of its own: (status, body)."""
        host, port = self.status[api].rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        try:
            conn.request(method, path, body, self.headers[api])
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def processes(self) -> list[psutil.Process]:
        """The frontend and all its children (templates, workers), those still there."""
        try:
            frontend = psutil.Process(self.pid)
            return [frontend, *frontend.children(recursive=True)]
        except psutil.Error:
            return []

    def worker_pids(self, model: str) -> list[int]:
        _, described = self.request("GET", f"/models/{model}", api="management")
        return [w["pid"] for w in json.loads(described)[0]["workers"]]

    def stop(self) -> None:
        """Stop the server and wait (bounded) until all its processes are gone: a torch
        worker's exit takes a core for a while, and the next figure's start must not share
        the machine with it."""
        tree = self.processes()
        subprocess.run([str(BIN / "mserve"), "--stop", "--run-dir", str(self.run_dir)],
                       capture_output=True, timeout=120)  # fmt: skip
        psutil.wait_procs(tree, timeout=30)


class Client:
    """One keep-alive connection per thread to one of a server's HTTP APIs."""

    def __init__(self, address: str, headers: dict[str, str]) -> None:
        host, port = address.rsplit(":", 1)
        self.host, self.port, self.headers = host, int(port), headers
        self._local = threading.local()

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        for attempt in (1, 2):  # a kept-alive connection the server closed: once more
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(
                    self.host, self.port, timeout=300
                )
            try:
                conn.request(method, path, body, self.headers)
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


# --- load ----------------------------------------------------------------------------------


def wrk_load(target: Target, path: str, body: bytes, conns: int, duration: int) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(
            'wrk.method = "POST"\n'
            f"wrk.body = {json.dumps(body.decode())}\n"
            'wrk.headers["Content-Type"] = "application/json"\n'
            f'wrk.headers["Authorization"] = "{target.headers["inference"]["Authorization"]}"\n'
        )
    url = f"http://{target.host}:{target.port}{path}"
    out = run(["wrk", "-t", str(min(2, conns)), "-c", str(conns), "-d", f"{duration}s",
               "--latency", "-s", script.name, url])  # fmt: skip
    os.unlink(script.name)
    text = out.stdout

    def latency_ms(label: str) -> float:
        m = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
        assert m, text
        scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]
        return float(m.group(1)) * scale

    found = re.search(r"Requests/sec:\s+([\d.]+)", text)
    assert found, text
    rps = float(found.group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    return {"rps": rps, "p50": latency_ms("50"), "p99": latency_ms("99"),
            "errors": float(errors.group(1)) if errors else 0.0}  # fmt: skip


def python_load(
    target: Target, path: str, body: bytes, conns: int, duration: int
) -> dict[str, float]:
    """Fallback when wrk is missing: one keep-alive connection per thread."""
    latencies: list[float] = []
    errors = [0]
    deadline = time.perf_counter() + duration
    lock = threading.Lock()

    def worker() -> None:
        conn = http.client.HTTPConnection(target.host, target.port, timeout=60)
        mine = []
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            conn.request("POST", path, body, target.headers["inference"])
            resp = conn.getresponse()
            resp.read()
            mine.append(time.perf_counter() - t0)
            if resp.status != 200:
                errors[0] += 1
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(conns)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {"rps": len(latencies) / elapsed, "p50": latencies[len(latencies) // 2] * 1000,
            "p99": latencies[int(len(latencies) * 0.99)] * 1000,
            "errors": float(errors[0])}  # fmt: skip


Load = Callable[[Target, str, bytes, int, int], dict[str, float]]


def load_generator() -> tuple[Load, str]:
    """wrk when installed, else the Python threads; and its name for the header line."""
    if shutil.which("wrk"):
        return wrk_load, "wrk"
    return python_load, "python threads"


def timed_calls(call: Callable[[], object], seconds: float) -> tuple[float, float]:
    """Call ``call`` one after another for ``seconds``: (calls per second, p50 in ms)."""
    latencies = []
    deadline = time.perf_counter() + seconds
    started = time.perf_counter()
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - t0)
    return len(latencies) / (time.perf_counter() - started), statistics.median(latencies) * 1000


# --- the machine ---------------------------------------------------------------------------


def measured(server: Server, model: str, load, path: str, body: bytes, conns: int,
             duration: int) -> dict[str, float]:  # fmt: skip
    """One load run plus the CPU the frontend and the model's workers spent per request: on a
    shared VM req/s swings between identical runs, CPU per request much less."""
    workers = server.worker_pids(model)
    frontend = [server.pid]
    before = cpu_seconds(frontend), cpu_seconds(workers)
    machine = psutil.cpu_times()
    r = load(server, path, body, conns, duration)
    r.update(cpu_split(machine, psutil.cpu_times()))
    requests = max(r["rps"] * duration, 1.0)
    r["frontend_us"] = (cpu_seconds(frontend) - before[0]) / requests * 1e6
    r["worker_us"] = (cpu_seconds(workers) - before[1]) / requests * 1e6
    return r


def scale(server: Server, model: str, workers: int) -> float:
    started = time.perf_counter()
    status, body = server.request(
        "PUT", f"/models/{model}?min_worker={workers}&synchronous=true", api="management"
    )
    assert status == 200, body
    return time.perf_counter() - started


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU the processes have used so far (gone ones count 0)."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def cpu_split(before: object, after: object) -> dict[str, float]:
    """The machine's CPU between two psutil.cpu_times() snapshots, in %: busy, steal (Linux
    only, else 0) and idle, so a slow row can be told from a row the hypervisor starved."""

    def delta(*fields: str) -> float:
        return sum(getattr(after, f, 0.0) - getattr(before, f, 0.0) for f in fields)

    busy = delta("user", "nice", "system", "irq", "softirq")
    steal = delta("steal")
    idle = delta("idle", "iowait")
    total = max(busy + steal + idle, 1e-9)
    return {"busy": busy / total * 100, "steal": steal / total * 100, "idle": idle / total * 100}


class Machine:
    """Load average and CPU steal over a phase, printed beside its figures."""

    def __init__(self) -> None:
        self._cpu = psutil.cpu_times()

    def since(self) -> str:
        """Since the last call (or the start): a text for the figures' line."""
        now = psutil.cpu_times()
        steal = getattr(now, "steal", 0.0) - getattr(self._cpu, "steal", 0.0)
        idle = now.idle - self._cpu.idle
        total = sum(now) - sum(self._cpu)
        busy = total - idle - steal
        load = os.getloadavg()
        self._cpu = now
        total = max(total, 1e-9)
        return (
            f"load avg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, cpu busy"
            f" {busy / total * 100:.0f}% steal {steal / total * 100:.0f}%"
        )


# --- instruction counts ------------------------------------------------------------------


# valgrind's callgrind: user-space instructions, the same from run to run whatever the machine's
# load or steal; Python runs ~50x slower under it. Add --callgrind-out-file=<prefix>.%p.
CALLGRIND = ("valgrind", "--tool=callgrind", "--trace-children=no")


def callgrind_per_call(
    pid: int, out: Path, drive: Callable[[int], None], n: int, warmup: int = 300
) -> float:
    """Instructions the process ``pid`` (running under callgrind, writing ``<out>.<pid>.*``)
    executes per call of ``drive``'s unit: ``drive(warmup)``, zero its counters, ``drive(n)``,
    dump, read the total."""
    drive(warmup)
    run(["callgrind_control", "-z", str(pid)])
    drive(n)
    run(["callgrind_control", "-d", str(pid)])
    time.sleep(1)
    dumps = sorted(out.parent.glob(f"{out.name}.{pid}.*"), key=lambda p: p.stat().st_mtime)
    for line in dumps[-1].read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1]) / n
    raise SystemExit(f"no totals in {dumps[-1]}")


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the rounds' runs."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}
