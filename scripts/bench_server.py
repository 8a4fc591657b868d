"""Serving benchmark: echo and a small torch MLP through a real mserve, figures printed.

Usage: python scripts/bench_server.py [--duration 10] [--quick] [--batching [--rounds 3] [--lone]]
       python scripts/bench_server.py --ceiling [--rounds 3] [--callgrind 2000]
       python scripts/bench_server.py --lean [--rounds 3] | --profile-start [--fresh]
       python scripts/bench_server.py --inference-log [--rounds 3]
       python scripts/bench_server.py --otel [--rounds 3] [--callgrind 2000]
       python scripts/bench_server.py --sandbox [--rounds 3] [--quick]

Measures requests/s, p50/p99 latency and CPU per request (frontend, workers: steadier than
req/s on a shared VM) at 1, 16 and 64 connections with 1 and 2 workers (wrk when installed, else
a bounded Python load generator), cold start (``mserve --start`` to the first successful
prediction), the frontend's RSS, and the time to scale the MLP from 1 to 4 workers
synchronously. The MLP: Linear 256-1024, ReLU, 1024-1024, ReLU, 1024-10, float32, seed 0,
one torch thread per worker; body ``{"data": [256 floats]}``.

``vs bare`` (MLP rows): served req/s over the MLP's own samples/s in a bare loop (JSON in and
out, same batch size, one thread; times the worker count), measured right after each run: this
VM's speed drifts by 2x within minutes, so only figures taken together compare. The loop decodes
with ``json.loads``, as a user's own would; mserve's workers decode request bodies with orjson
(mserve_worker/fastjson.py), so the last lines also give the loop decoding with orjson.

``--batching``: only the dynamic batching rows: the MLP at batch 1 (1 connection, the figure
batch 8 should reach there) and at batch 8 with a 5 ms delay at 1, 16 and 64 connections, one
worker, with the default ``batch_wait`` (``b8``) and with ``fill`` (``b8 fill``, TorchServe's
way: what every batch did before ``busy`` existed), each round taking every row in turn; then
each row's median over the rounds. Each round also prints ``b8/b1`` (and ``fill/b1``): batch 8's
req/s at 1 connection over batch 1's, taken in the same round (the 1-connection rows swap order
from one round to the next); the medians come with the median and range of those ratios. By
``busy``'s design a lone request costs nothing for a batch setting, so ``b8/b1`` should read
about 1 (``fill`` pays the delay on every request). ``--lone``: only the 1-connection rows. The
default run prints ``b8/b1`` at 1 connection too, for 1 and 2 workers.

``--ceiling``: only the echo model (1 worker, 16 connections) next to bare HTTP echo servers
started in the same run, round by round: a bare protocol over httptools and uvloop (what
server/http/ is built on, doing nothing else), the same plus a hop to a forked worker process
and back (the fair ceiling for a server whose handler runs elsewhere: against it mserve's
frontend and worker CPU count), that hop with its worker decoding and encoding the JSON body as
the echo handler's contract makes any worker do (``hop+json``: the same work on both sides, so
the ratio is what serving adds; ``hop+orjson`` the same with orjson, as mserve's workers read
and write JSON), and a raw ASGI app on uvicorn (when installed:
``pip install uvicorn``). CPU per request is the serving process's alone (for mserve the
frontend, as the worker's is not HTTP's), then the medians and the ratios to each bare server.
``--callgrind N`` adds a figure that does not move with the machine's load: the user-space
instructions per request of the frontend (and of the bare httptools echo) under valgrind's
callgrind, counted over N requests after a warm-up (valgrind runs Python ~50x slower: minutes).

``--lean``: cold start (``mserve --start`` to the first answer), PSS of all the server's
processes with one worker once they are quiet, and the first scale 1 -> 4 right after the first
answer, for echo and the MLP, one fresh server per figure: the very first start (nothing learned
yet) on its own, then the medians of ``--rounds`` rounds. Each round also times the floors a
cold start cannot beat, in the same run: a bare interpreter start (``python -I -c pass``) and,
for the MLP, ``import torch`` in a fresh interpreter (what its worker template must do); the
medians come with each cold start's ratio to its floor. ``--profile-start``: the steps of one
start, from the server log's time stamps (docs/server.md, Measuring cold start); with
``--fresh``, of a first start on a fresh run dir.

``--sandbox``: what confining the workers costs: each round, one fresh server per variant
(sandbox off; Landlock, no_new_privs and limits with workers under the server's user; the same
with a uid per model, when run as root), in turn: cold start to the first echo answer, a new
worker's start (scale 1 -> 2, synchronous) and req/s at 16 connections, for echo and the MLP;
then the medians and each variant's difference to the sandbox off.

Every cold start figure (these and the default run's) is taken with ``server``, ``archiver`` and
``mserve_worker`` byte-compiled first (``compileall``), as an installed wheel or an editable
install without ``PYTHONDONTWRITEBYTECODE`` has them: without ``.pyc`` files (this VM sets that
variable) each start recompiles our modules, ~0.09 s more that no user pays.

``--inference-log``: echo and the MLP with the inference log on for every request (both sinks)
against the same models without it, in one run (scripts/bench_inflog.py says how).
``--otel``: the same for tracing, off and on at sampling 1 (scripts/bench_otel.py).

``busy/steal/idle`` (every load row): the whole machine's CPU split during that run, from
/proc/stat (psutil) before and after. The hypervisor steals CPU from this VM (up to 32% seen
under load): a run taken while it steals X% is slower by about that much, so compare only rows
taken at low steal. The last line gives the median steal over all rows.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from bench_inflog import inference_log_rows
from bench_otel import otel_rows
from harness import (
    CALLGRIND,
    REPO,
    Server,
    build_archives,
    callgrind_per_call,
    cpu_seconds,
    cpu_split,
    load_generator,
    medians,
)


def start(work: Path, models: list[str], **settings: object) -> Server:
    """The server every figure here measures: the model API on (the MLP rows register
    models), token authorization on, as a user runs it."""
    return Server(work, {"enable_model_api": True, **settings}, models)


def bare_mlp(batch: int, seconds: float = 3.0, loads: Callable[[str], Any] = json.loads) -> float:
    """Samples/s of the MLP alone in a loop, JSON in and out, one thread: the ceiling (with
    ``json.loads``, as a user's own loop decodes; mserve's workers decode with orjson)."""
    import torch

    sys.path.insert(0, str(REPO / "examples" / "mlp"))
    from model import MLP

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP().eval()
    body = json.dumps({"data": [0.01 * i for i in range(256)]})
    done = 0
    deadline = time.perf_counter() + seconds
    started = time.perf_counter()
    with torch.inference_mode():
        while time.perf_counter() < deadline:
            rows = [loads(body)["data"] for _ in range(batch)]
            out = model(torch.tensor(rows, dtype=torch.float32)).tolist()
            json.dumps(out)
            done += batch
    return done / (time.perf_counter() - started)


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


def _row(label: str, workers: int, conns: int, r: dict[str, float]) -> str:
    bare = f" {r['rps'] / r['bare']:>7.2f}" if "bare" in r else " " * 8
    return (f"{label:<7} {workers:>6} {conns:>5} {r['rps']:>8.0f} {r['p50']:>7.2f}"
            f" {r['p99']:>7.2f} {int(r['errors']):>6} {r['frontend_us']:>9.0f}"
            f" {r['worker_us']:>9.0f}{bare}  busy {r['busy']:>3.0f}% steal {r['steal']:>3.0f}%"
            f" idle {r['idle']:>3.0f}%")  # fmt: skip


def scale(server: Server, model: str, workers: int) -> float:
    started = time.perf_counter()
    status, body = server.request(
        "PUT", f"/models/{model}?min_worker={workers}&synchronous=true", api="management"
    )
    assert status == 200, body
    return time.perf_counter() - started


HEADER = (
    f"{'model':<6} {'workers':>7} {'conns':>5} {'req/s':>8} {'p50 ms':>7}"
    f" {'p99 ms':>7} {'errors':>6} {'fe us/req':>9} {'wk us/req':>9} {'vs bare':>7}"
    "  machine CPU during the run"
)


def batching_rows(
    server: Server, load, body: bytes, duration: int, rounds: int, lone: bool = False
) -> None:
    """The MLP at batch 1 and 1 connection, then at batch 8 (5 ms delay) at 1, 16 and 64
    connections (``lone``: 1 only), batch_wait busy and fill, one worker; rows interleaved
    round by round, the 1-connection rows in the opposite order every other round; each
    round's b8/b1 and fill/b1 at 1 connection; then the medians."""
    batch8 = "&batch_size=8&max_batch_delay=5"
    for name, query in (("mlp", ""), ("mlp8", batch8), ("mlp8f", batch8 + "&batch_wait=fill")):
        s, b = server.request(
            "POST", f"/models?url=mlp.mar&model_name={name}&initial_workers=1{query}",
            api="management",
        )  # fmt: skip
        assert s == 200, b
        server.request("POST", f"/predictions/{name}", body)
    single = [("mlp", 1, 1), ("mlp8", 8, 1), ("mlp8f", 8, 1)]
    more = [] if lone else [(m, 8, c) for c in (16, 64) for m in ("mlp8", "mlp8f")]
    labels = {"mlp": "mlp", "mlp8": "b8", "mlp8f": "b8 fill"}
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    ratios: dict[str, list[float]] = {"b8/b1": [], "fill/b1": []}
    print(HEADER)
    for n in range(rounds):
        print(f"round {n + 1} of {rounds}")
        for model, batch, conns in (single if n % 2 == 0 else single[::-1]) + more:
            r = measured(server, model, load, f"/predictions/{model}", body, conns, duration)
            r["bare"] = bare_mlp(batch)
            results.setdefault((model, conns), []).append(r)
            print(_row(labels[model], 1, conns, r))
        b1 = results[("mlp", 1)][-1]["rps"]
        ratios["b8/b1"].append(results[("mlp8", 1)][-1]["rps"] / b1)
        ratios["fill/b1"].append(results[("mlp8f", 1)][-1]["rps"] / b1)
        print(
            "1 connection, this round: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in ratios.items())
        )
    print(f"medians over {rounds} round(s):")
    for model, _batch, conns in single + more:
        runs = results[(model, conns)]
        med = medians(runs)
        print(_row(labels[model], 1, conns, med))
    print("1 connection, req/s over batch 1's in the same round: " + "; ".join(
        f"{k} median {statistics.median(v):.2f} (rounds {min(v):.2f} to {max(v):.2f})"
        for k, v in ratios.items()
    ))  # fmt: skip
    steals = [r["steal"] for runs in results.values() for r in runs]
    print(f"median steal over {len(steals)} load rows: {statistics.median(steals):.0f}%"
          f" (max {max(steals):.0f}%)")  # fmt: skip


# --- lean workers, cold start, first scale ---------------------------------------------------

SETTLE_S = 30.0  # the longest to wait for the server's processes to go quiet after a start


def pss_mib(server: Server) -> float:
    """Proportional set size of the frontend, the templates and the workers together: pages
    shared between them (a template and the workers forked from it) count once in all."""
    total = 0
    for proc in server.processes():
        try:
            total += proc.memory_full_info().pss
        except psutil.Error:
            continue
    return total / 2**20


def settle(server: Server) -> None:
    """Wait (bounded) until the server's processes stop using CPU: the template has finished
    warming up, so what is measured is the steady state, not a snapshot of the import."""
    deadline = time.monotonic() + SETTLE_S
    last = -1.0
    while time.monotonic() < deadline:
        used = cpu_seconds([p.pid for p in server.processes()])
        if abs(used - last) < 0.01:
            return
        last = used
        time.sleep(0.5)


def byte_compile() -> None:
    """``.pyc`` files for our packages, as an installed wheel has them (see the docstring)."""
    import compileall

    for package in ("server", "archiver", "mserve_worker"):
        if not compileall.compile_dir(str(REPO / package), quiet=1):
            raise SystemExit(f"byte-compiling {package} failed")
    print("byte-compiled server, archiver, mserve_worker (.pyc, as an install has them)")


def interpreter_s(code: str, runs: int = 3) -> float:
    """Median wall time of a fresh ``python -I -c code`` (the server's interpreter) up to the
    end of ``code``, not of the interpreter's teardown (which takes ~0.1 s after torch and
    that no start waits for): a floor for a cold start, timed next to it."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-c", f"{code}\nimport os\nos._exit(0)"],
                       check=True, capture_output=True)  # fmt: skip
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


FLOORS = {"echo": ("bare interpreter", "pass"), "mlp": ("import torch", "import torch")}


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f}/{five:.1f}"


def one_start(work: Path, model: str, body: bytes, then: str) -> dict[str, float]:
    """A fresh server with ``model`` (one worker): seconds from ``mserve --start`` to its first
    answer; then either the PSS of all its processes once they are quiet (``pss``) or the time
    to scale it 1 -> 4 workers synchronously right after that answer (``scale``)."""
    t0 = time.perf_counter()
    server = start(work, [f"{model}={model}.mar"], snapshot=False)
    try:
        status, answer = server.request("POST", f"/predictions/{model}", body)
        assert status == 200, answer
        result = {"cold": time.perf_counter() - t0}
        if then == "pss":
            settle(server)
            result["pss"] = pss_mib(server)
        else:
            result["scale"] = scale(server, model, 4)
        return result
    finally:
        server.stop()


START_STEPS = [  # (what, a regular expression for the log line that ends it)
    ("server process up, imported, logging", r"."),
    ("HTTP listeners up", r"metrics API listening"),
    ("archive unpacked, model registered", r"registering {model}"),
    ("worker template ready", r"worker template for .* ready"),
    ("worker ready (handler loaded)", r"worker \d+ of {model}:\S+ ready"),
    ("gRPC listeners up (while workers load)", r"gRPC management API listening"),
    ("server ready", r"mserve \S+ ready"),
]


def profile_start(work: Path, model: str, body: bytes, fresh: bool = False) -> None:
    """Where the time from ``mserve --start`` to the first answer goes: the server log's
    time stamps of each step, from the start command on (one start, after one that taught the
    template what the model imports and warmed the page cache; ``fresh``: then on a fresh run
    dir, as a new machine's first start, nothing unpacked or learned)."""
    one_start(work, model, body, "pss")  # learn, and warm the page cache
    log_file = work / "run" / "logs" / "mserve.log"
    log_file.unlink(missing_ok=True)
    if fresh:
        shutil.rmtree(work / "run")
    t0 = time.time()
    server = start(work, [f"{model}={model}.mar"], snapshot=False)
    returned = time.time()
    status, _ = server.request("POST", f"/predictions/{model}", body)
    answered = time.time()
    server.stop()
    assert status == 200
    stamps = []
    for line in log_file.read_text().splitlines():
        m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", line)
        if m:
            at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
            stamps.append((at, line))
    if os.environ.get("BENCH_SHOW_LOG"):
        print(log_file.read_text())
    start_kind = "first start, fresh run dir" if fresh else "later start"
    print(f"{model}: mserve --start to first answer, {start_kind}, step by step"
          f" ({load_average()}):")  # fmt: skip
    for what, pattern in START_STEPS:
        regex = re.compile(pattern.format(model=re.escape(model)))
        found = next((at for at, line in stamps if regex.search(line)), None)
        print(f"  {what:<40} " + (f"{found - t0:6.2f} s" if found else "     - (not logged)"))
    print(f"  {'mserve --start returned':<40} {returned - t0:6.2f} s")
    print(f"  {'first answer':<40} {answered - t0:6.2f} s")
    what, code = FLOORS.get(model, FLOORS["echo"])
    print(f"  {'floor, ' + what + ' (same run)':<40} {interpreter_s(code):6.2f} s")


def lean_rows(work: Path, bodies: dict[str, bytes], rounds: int) -> None:
    """Cold start, memory and first scale of echo and the MLP, one fresh server per figure.

    The very first start learns what each model imports (nothing preloaded yet): it is shown
    on its own; then ``rounds`` rounds, each model in turn, and the medians."""
    models = list(bodies)
    for model in models:
        first = one_start(work, model, bodies[model], "scale")
        print(f"first start ever, {model}: cold start {first['cold']:.2f} s, first scale 1 -> 4"
              f" {first['scale']:.2f} s ({load_average()})")  # fmt: skip
    runs: dict[tuple[str, str], list[float]] = {}
    for n in range(rounds):
        for model in models:  # the floor, next to the starts it bounds (the VM drifts)
            what, code = FLOORS.get(model, FLOORS["echo"])
            floor = interpreter_s(code)
            runs.setdefault((model, "floor"), []).append(floor)
            print(f"round {n + 1}, {model}: floor ({what}) {floor:.2f} s ({load_average()})")
        for model in models:
            for then in ("pss", "scale"):
                machine = psutil.cpu_times()
                r = one_start(work, model, bodies[model], then)
                steal = cpu_split(machine, psutil.cpu_times())["steal"]
                runs.setdefault((model, "cold"), []).append(r["cold"])
                runs.setdefault((model, then), []).append(r[then])
                runs.setdefault((model, "steal"), []).append(steal)
                print(f"round {n + 1}, {model}: cold start {r['cold']:.2f} s, "
                      + (f"PSS {r['pss']:.0f} MiB" if then == "pss"
                         else f"first scale 1 -> 4 {r['scale']:.2f} s")
                      + f" (steal {steal:.0f}%, {load_average()})")  # fmt: skip
    print(f"medians over {rounds} round(s) ({load_average()}):")
    for model in models:
        cold, pss, first, floor = (runs[(model, k)] for k in ("cold", "pss", "scale", "floor"))
        what = FLOORS.get(model, FLOORS["echo"])[0]
        print(f"{model:<5} cold start to first answer {statistics.median(cold):.2f} s"
              f" (min {min(cold):.2f}; {statistics.median(cold) / statistics.median(floor):.1f}x"
              f" its floor, {what} {statistics.median(floor):.2f} s),"
              f" PSS 1 worker {statistics.median(pss):.0f} MiB,"
              f" first scale 1 -> 4 {statistics.median(first):.2f} s (max {max(first):.2f});"
              f" steal median {statistics.median(runs[(model, 'steal')]):.0f}%")  # fmt: skip


SANDBOX_VARIANTS = {  # what --sandbox compares, in this order each round
    "off": {"sandbox": False},
    "landlock": {"sandbox": True, "sandbox_uid_range": "off"},
    "landlock+uid": {"sandbox": True},  # a uid per model: only a root server switches users
}


def sandbox_round(work: Path, settings: dict[str, object], bodies: dict[str, bytes], load,
                  duration: int) -> dict[str, float]:  # fmt: skip
    """One fresh server: cold start to the first echo answer, a new echo worker's start
    (scale 1 -> 2, synchronous), echo req/s at 16 connections; with torch the same for the
    MLP (registered on the same server)."""
    r: dict[str, float] = {}
    t0 = time.perf_counter()
    server = start(work, ["echo=echo.mar"], snapshot=False, **settings)
    try:
        status, answer = server.request("POST", "/predictions/echo", bodies["echo"])
        assert status == 200, answer
        r["cold"] = time.perf_counter() - t0
        for model in bodies:
            if model != "echo":
                path = f"/models?url={model}.mar&initial_workers=1&synchronous=true"
                s, b = server.request("POST", path, api="management")
                assert s == 200, b
            server.request("POST", f"/predictions/{model}", bodies[model])
            r[f"{model} worker"] = scale(server, model, 2)
            scale(server, model, 1)
            m = measured(server, model, load, f"/predictions/{model}", bodies[model], 16,
                         duration)  # fmt: skip
            r[f"{model} rps"], r["steal"] = m["rps"], max(r.get("steal", 0.0), m["steal"])
    finally:
        server.stop()
    return r


def sandbox_rows(work: Path, bodies: dict[str, bytes], load, duration: int, rounds: int) -> None:
    """The sandbox's cost: each round starts one server per variant (off, Landlock alone,
    Landlock with a uid per model when root), in turn; then the medians and the differences
    to ``off``. Each figure comes from its own fresh server, so the whole cost shows: the
    rules each worker applies, the uid switch, the folders made reachable."""
    variants = [v for v in SANDBOX_VARIANTS if v != "landlock+uid" or os.geteuid() == 0]
    runs: dict[tuple[str, str], list[float]] = {}
    for n in range(rounds):
        for variant in variants:
            r = sandbox_round(work, SANDBOX_VARIANTS[variant], bodies, load, duration)
            for key, value in r.items():
                runs.setdefault((variant, key), []).append(value)
            shown = ", ".join(
                f"{k} {v:.0f}/s" if k.endswith("rps") else f"{k} {v * 1e3:.0f} ms"
                for k, v in r.items() if k != "steal"
            )  # fmt: skip
            print(f"round {n + 1}, sandbox {variant}: {shown} (steal {r['steal']:.0f}%,"
                  f" {load_average()})")  # fmt: skip
    print(f"medians over {rounds} round(s), the difference to sandbox off ({load_average()}):")
    keys = [k for (v, k) in runs if v == "off" and k != "steal"]
    for variant in variants:
        cells = []
        for key in keys:
            value = statistics.median(runs[(variant, key)])
            base = statistics.median(runs[("off", key)])
            if key.endswith("rps"):
                cells.append(f"{key} {value:.0f}/s ({(value / base - 1) * 100:+.1f}%)")
            else:
                cells.append(f"{key} {value * 1e3:.0f} ms ({(value - base) * 1e3:+.0f} ms)")
        print(f"  {variant:<13} " + ", ".join(cells))


def drop_page_cache() -> str | None:
    """Empty the kernel's page cache, as a new machine or pod starts (root only): None when
    done, else why not."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError as exc:
        return f"cannot drop the page cache ({exc.strerror}): run as root for the cold rows"
    return None


def first_start_rows(work: Path, bodies: dict[str, bytes], rounds: int) -> None:
    """The very first start of each model: a fresh run dir (nothing unpacked, no template
    preload learned), with a warm and with a dropped page cache, each beside its floor (a bare
    interpreter; ``import torch`` for the MLP) taken in the same cache state."""
    runs: dict[tuple[str, str, str], list[float]] = {}
    caches = ["warm", "cold"]
    why = drop_page_cache()
    if why:
        print(why)
        caches = ["warm"]
    for n in range(rounds):
        for cache in caches:
            for model, body in bodies.items():
                what, code = FLOORS.get(model, FLOORS["echo"])
                if cache == "cold":
                    drop_page_cache()
                floor = interpreter_s(code, runs=1)
                shutil.rmtree(work / "run", ignore_errors=True)
                if cache == "cold":
                    drop_page_cache()
                cold = one_start(work, model, body, "pss")["cold"]
                runs.setdefault((model, cache, "floor"), []).append(floor)
                runs.setdefault((model, cache, "start"), []).append(cold)
                print(f"round {n + 1}, {model}, {cache} page cache: first start {cold:.2f} s,"
                      f" floor ({what}) {floor:.2f} s ({load_average()})")  # fmt: skip
    print(f"medians over {rounds} round(s):")
    for model in bodies:
        for cache in caches:
            start_s = statistics.median(runs[(model, cache, "start")])
            floor_s = statistics.median(runs[(model, cache, "floor")])
            print(f"{model:<5} {cache} page cache: first start to first answer {start_s:.2f} s,"
                  f" floor {floor_s:.2f} s, +{start_s - floor_s:.2f} s over it")  # fmt: skip


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
                   bare: bool = True) -> float:  # fmt: skip
    """Instructions per request of the frontend alone (callgrind: user-space instructions,
    the same from run to run whatever the machine's load or steal), N echo requests over 16
    connections after 300 to warm up, and of the bare httptools echo the same way. The worker
    runs natively (valgrind follows no child). ``extra``: more config lines (YAML);
    returns the frontend's count."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 s runs, 16 connections only")
    parser.add_argument("--batching", action="store_true", help="only the batching rows")
    parser.add_argument("--lone", action="store_true",
                        help="with --batching: only the 1-connection rows")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of --batching, --ceiling and --lean rows")  # fmt: skip
    parser.add_argument("--ceiling", action="store_true",
                        help="only echo CPU per request beside bare HTTP echo servers")  # fmt: skip
    parser.add_argument("--callgrind", type=int, default=0, metavar="N",
                        help="--ceiling/--otel/--inference-log: instructions per request,"
                             " N requests")  # fmt: skip
    parser.add_argument(
        "--lean", action="store_true", help="only cold start, memory (PSS) and first scale rows"
    )
    parser.add_argument(
        "--first-start",
        action="store_true",
        help="only the very first start (fresh run dir), warm and dropped page cache (root)",
    )
    parser.add_argument(
        "--inference-log",
        action="store_true",
        help="only echo and MLP throughput with the inference log on (both sinks) vs off",
    )
    parser.add_argument(
        "--otel", action="store_true", help="only echo and MLP throughput with tracing on vs off"
    )
    parser.add_argument(
        "--sandbox",
        action="store_true",
        help="only cold start, a new worker's start and req/s with the sandbox off and on",
    )
    parser.add_argument(
        "--profile-start",
        action="store_true",
        help="only the steps from mserve --start to the first answer",
    )
    parser.add_argument(
        "--fresh", action="store_true", help="with --profile-start: on a fresh run dir"
    )
    args = parser.parse_args()
    duration = 3 if args.quick else args.duration
    conn_levels = [16] if args.quick else [1, 16, 64]
    try:
        import torch  # noqa: F401

        with_mlp = True
    except ImportError:
        with_mlp = False
        print("torch is not installed: MLP figures skipped (pip install torch==2.13.0)")
    load, generator = load_generator()
    print(f"load generator: {generator}; {duration} s per run")

    work = Path(tempfile.mkdtemp(prefix="bench-server-"))
    try:
        byte_compile()
        build_archives(work, with_mlp and not args.ceiling)
        if args.sandbox:
            bodies = {"echo": b'{"x": 1}'}
            if with_mlp:
                bodies["mlp"] = json.dumps({"data": [0.01 * i for i in range(256)]}).encode()
            sandbox_rows(work, bodies, load, duration, args.rounds)
            return
        if args.lean or args.profile_start or args.first_start:
            bodies = {"echo": b'{"x": 1}'}
            if with_mlp:
                bodies["mlp"] = json.dumps({"data": [0.01 * i for i in range(256)]}).encode()
            for model, body in bodies.items():
                if args.profile_start:
                    profile_start(work, model, body, args.fresh)
            if args.lean:
                lean_rows(work, bodies, args.rounds)
            if args.first_start:
                first_start_rows(work, bodies, args.rounds)
            return
        # cold start: start command to the first successful prediction
        t0 = time.perf_counter()
        server = start(work, ["echo=echo.mar"])
        status, _ = server.request("POST", "/predictions/echo", b'{"x": 1}')
        cold = time.perf_counter() - t0
        assert status == 200
        print(
            f"cold start to first answer (echo): {cold:.2f} s"
            f" (start returned after {server.ready_s:.2f} s)"
        )
        bodies = {"echo": json.dumps({"data": [0.5] * 256}).encode()}
        if args.inference_log or args.otel:
            server.stop()
            if with_mlp:
                bodies["mlp"] = json.dumps({"data": [0.01 * i for i in range(256)]}).encode()
            grind = None
            if args.callgrind:

                def grind(w: Path, body: bytes, extra: str, label: str) -> float:
                    return callgrind_rows(w, body, args.callgrind, extra, label, bare=False)

            rows = inference_log_rows if args.inference_log else otel_rows
            rows(work, load, bodies, duration, args.rounds, measured, grind)
            return
        if args.ceiling:
            ceiling_rows(server, load, bodies["echo"], duration, args.rounds)
            server.stop()
            if args.callgrind:
                callgrind_rows(work, bodies["echo"], args.callgrind)
            return
        if args.batching:
            if not with_mlp:
                raise SystemExit("--batching needs torch")
            mlp_body = json.dumps({"data": [0.01 * i for i in range(256)]}).encode()
            batching_rows(server, load, mlp_body, duration, args.rounds, args.lone)
            server.stop()
            return
        models = ["echo"]
        if with_mlp:
            path = "/models?url=mlp.mar&initial_workers=1"
            s, b = server.request("POST", path, api="management")
            assert s == 200, b
            bodies["mlp"] = json.dumps({"data": [0.01 * i for i in range(256)]}).encode()
            models.append("mlp")
        print(HEADER)
        steals: list[float] = []
        lone: dict[tuple[str, int], float] = {}  # (model, workers): req/s at 1 connection
        for model in models:
            for workers in (1, 2):
                scale(server, model, workers)
                server.request("POST", f"/predictions/{model}", bodies[model])
                for conns in conn_levels:
                    r = measured(server, model, load, f"/predictions/{model}", bodies[model],
                                 conns, duration)  # fmt: skip
                    if model == "mlp":  # the ceiling, measured next to the run it bounds
                        r["bare"] = bare_mlp(1) * workers
                    steals.append(r["steal"])
                    if conns == 1:
                        lone[(model, workers)] = r["rps"]
                    print(_row(model, workers, conns, r))
            scale(server, model, 1)
        if with_mlp:  # dynamic batching: batch 8, 5 ms delay
            path = "/models?url=mlp.mar&model_name=mlp8&batch_size=8&max_batch_delay=5"
            s, b = server.request("POST", path, api="management")
            assert s == 200, b
            for workers in (1, 2):
                scale(server, "mlp8", workers)
                for conns in conn_levels:
                    r = measured(server, "mlp8", load, "/predictions/mlp8", bodies["mlp"],
                                 conns, duration)  # fmt: skip
                    r["bare"] = bare_mlp(8) * workers
                    steals.append(r["steal"])
                    if conns == 1:
                        lone[("mlp8", workers)] = r["rps"]
                    print(_row("mlp b8", workers, conns, r))
            if ("mlp", 1) in lone and ("mlp8", 1) in lone:  # not with --quick (16 only)
                print("mlp at 1 connection, b8/b1 (batch 8's req/s over batch 1's, rows taken"
                      " minutes apart; --batching --lone pairs them round by round): " + ", ".join(
                    f"{w} worker(s) {lone[('mlp8', w)] / lone[('mlp', w)]:.2f}" for w in (1, 2)
                ))  # fmt: skip
        print(
            f"median steal over {len(steals)} load rows: {statistics.median(steals):.0f}%"
            f" (max {max(steals):.0f}%): compare only rows taken at low steal"
        )
        rss = psutil.Process(server.pid).memory_info().rss
        print(f"frontend RSS after load: {rss / 2**20:.0f} MiB")
        if with_mlp:
            times = []
            for _ in range(3):
                times.append(scale(server, "mlp", 4))
                scale(server, "mlp", 1)
            runs = ", ".join(f"{t:.2f}" for t in times)
            median = statistics.median(times)
            print(f"scale mlp 1 -> 4 workers, synchronous: median {median:.2f} s (runs: {runs})")
        server.stop()
        if with_mlp:
            for batch in (1, 8):
                line = f"bare MLP loop, batch {batch}: {bare_mlp(batch):.0f} samples/s"
                with contextlib.suppress(ImportError):
                    import orjson

                    line += f" ({bare_mlp(batch, loads=orjson.loads):.0f} decoding with orjson)"
                print(line)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
