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
start, from the server log's time stamps (docs/explanations/measuring.md, Measuring cold start);
with ``--fresh``, of a first start on a fresh run dir.

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

One file for the serving figures docs/explanations/measuring.md quotes, one mode a few functions
each, sharing the load and measuring helpers (harness.py); the modes with code of their own live
beside it (bench_ceiling.py, bench_inflog.py, bench_otel.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from bench_ceiling import callgrind_rows, ceiling_rows
from bench_inflog import inference_log_rows
from bench_otel import otel_rows
from harness import (
    REPO,
    Server,
    build_archives,
    cpu_seconds,
    cpu_split,
    load_generator,
    measured,
    medians,
    scale,
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


def _row(label: str, workers: int, conns: int, r: dict[str, float]) -> str:
    bare = f" {r['rps'] / r['bare']:>7.2f}" if "bare" in r else " " * 8
    return (f"{label:<7} {workers:>6} {conns:>5} {r['rps']:>8.0f} {r['p50']:>7.2f}"
            f" {r['p99']:>7.2f} {int(r['errors']):>6} {r['frontend_us']:>9.0f}"
            f" {r['worker_us']:>9.0f}{bare}  busy {r['busy']:>3.0f}% steal {r['steal']:>3.0f}%"
            f" idle {r['idle']:>3.0f}%")  # fmt: skip


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
