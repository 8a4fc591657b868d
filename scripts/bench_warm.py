"""Big models on one server: the warm tier's wake against a cold load, and eviction by cost.

Each model is a stack of ``Linear(width, width)`` layers with weights made here from a fixed
seed (``torch.save`` of its state dict), archived with the archiver CLI (uncompressed), served
by a ``BaseHandler`` subclass that only adds a seeded input and answers a digest of the output
and when its worker loaded the model (a request sent before that waited for a load).

1. ``single``: one model of ``--size-mb`` (1 GiB by default). Each round, on a server without
   the warm tier: a load with the weights' pages dropped from the page cache (cold from disk:
   read, unpickle, random init, copy) and one with them cached; on a server with the warm tier:
   a cold load (pages dropped; mapped), then, once its idle unload put it in the warm tier, a
   wake. Printed: the medians of the time from the request to its answer, the ratio, and
   whether the woken model answered what the cold one did.
   ``wake``: the warm tier's wake alone, step by step (the worker's start as the server logs
   it, the first forward pass), against a forward pass of the loaded model. ``steps``: the
   worker's load steps in one process, the way it did them before this cut and the way it
   does them now, alternately.
2. ``zipf``: ``--models`` models of ``--size-mb`` each, room for ``--loaded`` of them
   (``max_loaded_models``), ``--clients`` threads asking for models drawn from a Zipf-like law
   for ``--duration`` seconds; with a warm tier of ``--warm-mb`` (evicted models' workers
   parked), with the tier but no parked workers, and without the tier (``--runs``). Printed:
   requests, errors, how many waited for a load and their p50/p99 (and by where the load came
   from: a parked worker woken, the warm tier's pages, cold), loads by tier, seconds spent
   loading (the server's ``mserve_model_load_seconds`` sum).
3. ``cost``: the same Zipf run with the warm tier on, the models alternately ``--size-mb`` and
   ``--size-mb / --ratio`` (expensive and cheap to bring back), ``eviction: cost`` against
   ``eviction: lru``: seconds spent loading and the loads of each kind.

Pages are dropped with ``posix_fadvise(DONTNEED)`` after an fsync (no root needed). The
machine's load is printed with each figure: on a shared machine compare runs of similar load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from harness import REPO, Client, Machine, Server, wait_until

MIB = 2**20
ARCHIVER = str(Path(sys.executable).parent / "model-archiver")

STACK = """import torch
from torch import nn

WIDTH = {width}
DEPTH = {depth}


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layers(x))
"""

HANDLER = """import hashlib
import os
import time

import torch
from stack import WIDTH

from mserve_worker.sdk.base_handler import BaseHandler


class Handler(BaseHandler):
    def initialize(self, context):
        started = time.time()
        super().initialize(context)
        self.loaded_at = time.time()
        self.initialize_s = self.loaded_at - started
        self.forward_s = []

    def preprocess(self, data):
        return torch.randn(len(data), WIDTH, generator=torch.Generator().manual_seed(7))

    def inference(self, data):
        started = time.perf_counter()
        with torch.no_grad():
            out = self.model(data)
        self.forward_s.append(time.perf_counter() - started)
        return out

    def postprocess(self, output):
        return [{{"digest": hashlib.sha256(row.numpy().tobytes()).hexdigest(),
                 "loaded_at": self.loaded_at, "pid": os.getpid(),
                 "initialize_s": self.initialize_s, "forward_s": self.forward_s[-1],
                 "forwards": len(self.forward_s), "weights": self.model_pt_path}}
                for row in output]
"""


def build(work: Path, name: str, size_mb: float, seed: int) -> None:
    """The archive ``<work>/store/<name>.mar`` of a model of about ``size_mb`` (float32)."""
    import torch

    width = 2048 if size_mb >= 64 else 512
    depth = max(1, round(size_mb * MIB / (4 * width * (width + 1))))
    src = work / "src" / name
    stamp = json.dumps({"size_mb": size_mb, "seed": seed, "handler": HANDLER})
    built = src / "built.json"  # --work: built by an earlier run
    if (work / "store" / f"{name}.mar").exists() and built.exists() and built.read_text() == stamp:
        return
    src.mkdir(parents=True, exist_ok=True)
    (src / "stack.py").write_text(STACK.format(width=width, depth=depth))
    (src / "handler.py").write_text(HANDLER.format())
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(depth):  # the state dict of Stack, without building (and initialising) it
        state[f"layers.{i}.weight"] = torch.randn(width, width, generator=gen) / width**0.5
        state[f"layers.{i}.bias"] = torch.zeros(width)
    torch.save(state, src / "weights.pt")
    del state
    (work / "store").mkdir(exist_ok=True)
    subprocess.run(
        [ARCHIVER, "--model-name", name, "--handler", str(src / "handler.py"),
         "--model-file", str(src / "stack.py"), "--serialized-file", str(src / "weights.pt"),
         "--export-path", str(work / "store"), "--archive-format", "zip-store", "-f"],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    (src / "weights.pt").unlink()
    (src / "built.json").write_text(stamp)


class Mserve(Server):
    def __init__(self, work: Path, name: str, settings: dict[str, Any]) -> None:
        shutil.rmtree(work / f"run-{name}", ignore_errors=True)  # --work: an earlier run's
        super().__init__(work, {"enable_model_api": True, "grpc": False, **settings}, name=name)
        self.inference = Client(self.status["inference"], self.headers["inference"])
        self.management = Client(self.status["management"], self.headers["management"])
        self.metrics = Client(self.status["metrics"], {})

    def register(self, name: str, idle_s: float = 0) -> None:
        status, body = self.management.request(
            "POST", f"/models?url={name}.mar&model_name={name}&initial_workers=0"
            f"&idle_unload_timeout={idle_s:g}",
        )  # fmt: skip
        if status != 200:
            raise SystemExit(f"registering {name}: {status} {body[:300]!r}")

    def unregister(self, name: str) -> None:
        self.management.request("DELETE", f"/models/{name}")

    def ask(self, name: str) -> tuple[float, float, dict[str, Any] | None]:
        """(sent at, seconds to the answer, the answer or None on an error)."""
        sent = time.time()
        status, body = self.inference.request("POST", f"/predictions/{name}", b"{}")
        took = time.time() - sent
        return sent, took, json.loads(body) if status == 200 else None

    def footprint(self, name: str) -> dict[str, Any]:
        _s, body = self.management.request("GET", f"/models/{name}")
        return json.loads(body)[0]["footprint"]

    def counters(self, metric: str) -> dict[str, float]:
        """A counter's values by their label sets."""
        _s, body = self.metrics.request("GET", "/metrics")
        out: dict[str, float] = {}
        for line in body.decode().splitlines():
            if line.startswith(metric):
                key, _, value = line.rpartition(" ")
                out[key[len(metric) :]] = float(value)
        return out

    def total(self, metric: str, having: str = "") -> float:
        return sum(v for k, v in self.counters(metric).items() if having in k)


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def single(args: argparse.Namespace, work: Path) -> None:
    print(f"building a {args.size_mb:g} MiB model ...", flush=True)
    build(work, "big", args.size_mb, 1)
    size = (work / "store" / "big.mar").stat().st_size
    machine = Machine()
    off = Mserve(work, "off", {})
    times: dict[str, list[float]] = {"off_disk": [], "off_cached": [], "on_disk": [], "wake": []}
    digests: set[str] = set()
    server_s: dict[str, list[float]] = {"off_disk": [], "off_cached": [], "on_disk": [], "wake": []}
    try:
        off.register("big", idle_s=1)
        for _round in range(args.rounds):
            answer = _settled_cold(off, "big")
            drop_cache(answer["weights"])
            times["off_disk"].append(_load(off, "big", digests))
            server_s["off_disk"].append(off.footprint("big")["coldLoadSeconds"])
            _unloaded(off, "big")
            times["off_cached"].append(_load(off, "big", digests))
            server_s["off_cached"].append(off.footprint("big")["coldLoadSeconds"])
            _unloaded(off, "big")
    finally:
        off.stop()
    on = Mserve(work, "on", {"warm_tier_budget_mb": int(args.warm_mb)})
    try:
        on.register("big", idle_s=1)
        first = _settled_cold(on, "big")  # a first load tells where the weights are
        for _round in range(args.rounds):
            on.unregister("big")  # its warm copy is dropped (within 5 s)
            wait_until(lambda: not on.total("mserve_models_warm"), 30, "big dropped")
            drop_cache(first["weights"])
            on.register("big", idle_s=1)
            times["on_disk"].append(_load(on, "big", digests))
            wait_until(lambda: on.footprint("big")["tier"] == "warm", 60, "big warm")
            warm_footprint = on.footprint("big")
            times["wake"].append(_load(on, "big", digests))
            server_s["on_disk"].append(on.footprint("big")["coldLoadSeconds"])
            server_s["wake"].append(on.footprint("big")["warmWakeSeconds"])
            wakes = on.total("mserve_model_wakes_total", 'tier="warm"')
        print(f"warm wakes counted by the server: {wakes:g}")
        print(f"describe's footprint while warm: {json.dumps(warm_footprint)}")
    finally:
        on.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    load = {k: statistics.median(v) for k, v in server_s.items()}
    print(f"\n{args.size_mb:g} MiB model ({size / MIB:.0f} MiB archive), {args.rounds} rounds,"
          f" medians (request to answer); {machine.since()}")  # fmt: skip
    print("  (first answer: request to answer; load: the server's, request to worker ready)")
    for key, what in (("off_disk", "warm tier off, cold (pages dropped)"),
                      ("off_cached", "warm tier off, weights in page cache"),
                      ("on_disk", "warm tier on, cold (pages dropped)"),
                      ("wake", "warm tier on, woken from warm")):  # fmt: skip
        print(f"  {what:38s} first answer {med[key]:6.2f} s  load {load[key]:6.2f} s  {times[key]}")
    print(
        f"  cold / wake: {med['off_disk'] / med['wake']:.0f}x (off, from disk),"
        f" {med['off_cached'] / med['wake']:.0f}x (off, page cache)"
    )
    print(f"  same answer every time: {len(digests) == 1}")


def wake(args: argparse.Namespace, work: Path) -> None:
    """The warm tier's wake, step by step: a cold load, a request to the loaded model (what a
    forward pass costs when loaded), then ``--rounds`` wakes from warm, each with the steps of
    its worker's start as the server logged them (its ``worker ... ready`` line)."""
    print(f"building a {args.size_mb:g} MiB model ...", flush=True)
    build(work, "big", args.size_mb, 1)
    machine = Machine()
    on = Mserve(work, "wake", {"warm_tier_budget_mb": int(args.warm_mb)})
    rows: list[tuple[float, dict[str, Any], str]] = []
    try:
        on.register("big", idle_s=1)
        _sent, cold_s, first = on.ask("big")
        if first is None:
            raise SystemExit("big did not answer")
        loaded = [on.ask("big") for _ in range(3)]
        for _round in range(args.rounds):
            _unloaded(on, "big")
            wait_until(lambda: on.footprint("big")["tier"] == "warm", 60, "big warm")
            time.sleep(0.5)  # the tier's mapping made
            _sent, took, answer = on.ask("big")
            if answer is None:
                raise SystemExit("big failed to wake")
            rows.append((took, answer, _ready_line(on)))
    finally:
        on.stop()
    print(f"\n{args.size_mb:g} MiB model, warm tier on; {machine.since()}")
    print(f"  cold load, request to answer {cold_s:.3f} s (first forward"
          f" {first['forward_s']:.3f} s, initialize {first['initialize_s']:.3f} s)")  # fmt: skip
    fwd = statistics.median(a["forward_s"] for _s, _t, a in loaded if a)
    ask = statistics.median(t for _s, t, _a in loaded)
    print(f"  loaded: request to answer {ask:.3f} s, forward {fwd:.3f} s (median of 3)")
    for took, answer, line in rows:
        print(f"  wake: request to answer {took:.3f} s = first forward {answer['forward_s']:.3f}"
              f" s + the rest {took - answer['forward_s']:.3f} s (initialize"
              f" {answer['initialize_s']:.3f} s)\n    {line}")  # fmt: skip
    med = statistics.median(t for t, _a, _l in rows)
    over = statistics.median(t - a["forward_s"] for t, a, _l in rows)
    print(f"  wake median {med:.3f} s: overhead {over:.3f} s + forward; cold / wake"
          f" {cold_s / med:.0f}x")  # fmt: skip


STEPS = """import ctypes, mmap, sys, time
import torch
sys.path.insert(0, {model_dir!r})
from stack import Stack
from mserve_worker.sdk import weights

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def madvise_populate(state):  # what the worker did before: MADV_POPULATE_READ
    for t in state.values():
        s = t.untyped_storage()
        start = s.data_ptr() - s.data_ptr() % mmap.PAGESIZE
        libc.madvise(start, s.nbytes() + s.data_ptr() - start, 22)


def clocks():
    return time.perf_counter(), time.process_time()


rows = {{}}
x = torch.randn(1, {width}, generator=torch.Generator().manual_seed(7))
for rnd in range({rounds}):
    for way in ("before", "after"):
        out = {{}}
        t = clocks()
        state = torch.load({weights!r}, mmap=True, weights_only=True)
        out["torch.load(mmap)"], t = [a - b for a, b in zip(clocks(), t)], clocks()
        (madvise_populate if way == "before" else weights._populate)(state)
        out["pages touched"], t = [a - b for a, b in zip(clocks(), t)], clocks()
        if way == "before":
            with torch.device("meta"):
                model = Stack()
            model.load_state_dict(state, assign=True)
        else:
            model = weights.build_with_state(Stack, state)
        out["module built"], t = [a - b for a, b in zip(clocks(), t)], clocks()
        with torch.no_grad():
            model(x)
        out["first forward"], t = [a - b for a, b in zip(clocks(), t)], clocks()
        with torch.no_grad():
            model(x)
        out["forward, loaded"], t = [a - b for a, b in zip(clocks(), t)], clocks()
        for k, v in out.items():
            rows.setdefault((way, k), []).append(v)
        del model, state
print(repr(rows))
"""


def steps(args: argparse.Namespace, work: Path) -> None:
    """The worker's load steps in one process, as the worker did them before (pages mapped
    with ``MADV_POPULATE_READ``, the module built on ``meta`` with its initialisers running)
    and does now (a read per page, initialisers off), alternately in the same run: wall and
    CPU seconds (CPU tells more on a loaded machine). The weights in the page cache, as in a
    wake."""
    import ast
    import zipfile

    build(work, "big", args.size_mb, 1)
    folder = work / "steps"
    weights = folder / "weights.pt"
    if not weights.exists():  # written in 1 MiB chunks, as the server unpacks an archive: the
        # page cache then holds it in large folios, which a fault maps many pages of at once
        folder.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(work / "store" / "big.mar") as mar:
            mar.extract("stack.py", folder)
            with mar.open("weights.pt") as src, open(weights, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    Path(weights).read_bytes()  # into the page cache
    width = 2048 if args.size_mb >= 64 else 512
    machine = Machine()
    code = STEPS.format(model_dir=str(folder), width=width, rounds=args.rounds,
                        weights=str(weights))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=1800, env=env)  # fmt: skip
    rows = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    print(f"\n{args.size_mb:g} MiB model, the worker's load steps in process, {args.rounds}"
          f" rounds, medians, wall / CPU seconds; {machine.since()}")  # fmt: skip
    for step in ("torch.load(mmap)", "pages touched", "module built", "first forward",
                 "forward, loaded"):  # fmt: skip
        cells = []
        for way in ("before", "after"):
            runs = rows[(way, step)]
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            cells.append(f"{way} {wall:6.3f} / {cpu:6.3f}")
        print(f"  {step:18s} {cells[0]}   {cells[1]}")


def _ready_line(server: Mserve) -> str:
    """The server log's last ``worker ... of big... ready`` line, from ``ready in``."""
    found = ""
    for log in server.run_dir.glob("logs/mserve.log"):
        for line in log.read_text(errors="replace").splitlines():
            if " of big:" in line and " ready in " in line:
                found = line[line.index("ready in") :]
    return found


def _settled_cold(server: Mserve, name: str) -> dict[str, Any]:
    _sent, _took, answer = server.ask(name)
    if answer is None:
        raise SystemExit(f"{name} did not answer")
    _unloaded(server, name)
    return answer


def _unloaded(server: Mserve, name: str) -> None:
    wait_until(lambda: server.footprint(name)["tier"] != "loaded", 60, f"{name} unloaded")
    time.sleep(0.5)  # its worker's exit


def _load(server: Mserve, name: str, digests: set[str]) -> float:
    _sent, took, answer = server.ask(name)
    if answer is None:
        raise SystemExit(f"{name} failed to load")
    digests.add(answer["digest"])
    return round(took, 3)


def zipf_run(args: argparse.Namespace, work: Path, label: str, settings: dict[str, Any],
             names: list[str]) -> dict[str, Any]:  # fmt: skip
    machine = Machine()
    server = Mserve(work, label, {"max_loaded_models": args.loaded, "load_wait_s": 120,
                                  **settings})  # fmt: skip
    order = names[:]
    random.Random(7).shuffle(order)
    weights = [1 / (i + 1) ** args.zipf for i in range(len(order))]
    # (sent at, seconds, ok, model, the handler's forward pass in seconds)
    results: list[tuple[float, float, bool, str, float]] = []
    lock = threading.Lock()
    try:
        for name in names:
            server.register(name)
        deadline = time.time() + args.duration

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.time() < deadline:
                name = rng.choices(order, weights)[0]
                sent, took, answer = server.ask(name)
                forward = answer["forward_s"] if answer else 0.0
                with lock:
                    results.append((sent, took, answer is not None, name, forward))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        loads = server.counters("mserve_model_load_seconds_sum")
        by_model: dict[str, float] = {}
        for key, value in server.counters("mserve_model_loads_total").items():
            if 'outcome="ok"' in key:
                model = key.split('model="', 1)[1].split('"', 1)[0]
                by_model[model] = by_model.get(model, 0.0) + value
        # {tier: [seconds]} of those that waited; the same less their forward pass
        waits, beyond, hits = _waits(server, results)
        out = {
            "label": label,
            "requests": len(results),
            "errors": sum(1 for r in results if not r[2]),
            "waited": sorted(w for tier in waits.values() for w in tier),
            "hits": hits,
            "by_tier": waits,
            "beyond": beyond,
            "warm": server.total("mserve_model_wakes_total", 'tier="warm"'),
            "cold": server.total("mserve_model_wakes_total", 'tier="cold"'),
            "drops": server.total("mserve_warm_tier_drops_total"),
            "load_s": sum(loads.values()),
            "loads_by_model": by_model,
            "machine": machine.since(),
        }
    finally:
        server.stop()
    _print_run(out)
    return out


def _waits(
    server: Mserve, results: list[tuple[float, float, bool, str, float]]
) -> tuple[dict[str, list[float]], dict[str, list[float]], list[float]]:
    """The time to the answer of each request that waited for a load on demand, by where the
    load came from, the same less the handler's forward pass (what the wait itself added), and
    the time of the others (served by a loaded model). The server logs each load when it ends
    ("model m:1.0 loaded on demand in N s", then "(woken from the warm tier: its parked
    worker)", "(woken from the warm tier)" or "(cold)"); a request waited when a load of its
    model ran while it was out (its model had no worker: every model here has at most one).
    Read from the log, not from the answer: a parked worker's handler was loaded long before
    its wake."""
    loads: dict[str, list[tuple[float, float, str]]] = {}  # model: (start, end, tier)
    found = re.compile(r"^(\S+ \S+) INFO \S+: model (\S+):\S+ loaded on demand in (\S+) s(.*)$")
    for log in server.run_dir.glob("logs/mserve.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = found.match(line)
            if m is None:
                continue
            end = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            tier = ("parked" if "its parked worker" in m.group(4)
                    else "warm" if "warm tier" in m.group(4) else "cold")  # fmt: skip
            loads.setdefault(m.group(2), []).append((end - float(m.group(3)) - 0.005, end, tier))
    out: dict[str, list[float]] = {"parked": [], "warm": [], "cold": []}
    beyond: dict[str, list[float]] = {"parked": [], "warm": [], "cold": []}
    hits, hits_beyond = [], []
    for sent, took, ok, name, forward in results:
        if not ok:
            continue
        tier = next((t for s, e, t in loads.get(name, []) if s <= sent + took and e >= sent), None)
        if tier is None:
            hits.append(took)
            hits_beyond.append(took - forward)
        else:
            out[tier].append(took)
            beyond[tier].append(took - forward)
    return (
        {tier: sorted(waits) for tier, waits in out.items()},
        {**{tier: sorted(waits) for tier, waits in beyond.items()}, "hit": sorted(hits_beyond)},
        sorted(hits),
    )


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def _print_run(r: dict[str, Any]) -> None:
    print(f"  {r['label']}: {r['requests']} requests, {r['errors']} errors;"
          f" {len(r['waited'])} waited for a load: p50 {_pct(r['waited'], 0.5):.2f} s,"
          f" p99 {_pct(r['waited'], 0.99):.2f} s; hits p50 {_pct(r['hits'], 0.5) * 1000:.0f} ms"
          f" p99 {_pct(r['hits'], 0.99) * 1000:.0f} ms (less the forward pass p50"
          f" {_pct(r['beyond']['hit'], 0.5) * 1000:.0f} ms p99"
          f" {_pct(r['beyond']['hit'], 0.99) * 1000:.0f} ms);"
          f" loads warm {r['warm']:g} cold {r['cold']:g}; warm drops {r['drops']:g};"
          f" {r['load_s']:.1f} s loading in all; {r['machine']}", flush=True)  # fmt: skip
    by_tier = r["by_tier"]
    if by_tier["warm"] or by_tier["parked"]:
        woken = sorted(by_tier["warm"] + by_tier["parked"])
        print(f"    waited for a wake from the warm tier (parked or not): {len(woken)}, p50"
              f" {_pct(woken, 0.5):.2f} s, p99 {_pct(woken, 0.99):.2f} s", flush=True)  # fmt: skip
        for tier, waits in by_tier.items():
            beyond = r["beyond"][tier]
            print(f"    waited for a {tier} load: {len(waits)}, p50 {_pct(waits, 0.5):.2f} s,"
                  f" p99 {_pct(waits, 0.99):.2f} s; less the forward pass p50"
                  f" {_pct(beyond, 0.5):.2f} s, p99 {_pct(beyond, 0.99):.2f} s",
                  flush=True)  # fmt: skip


def zipf(args: argparse.Namespace, work: Path) -> None:
    names = [f"m{i:02d}" for i in range(args.models)]
    print(f"building {args.models} models of {args.size_mb:g} MiB ...", flush=True)
    for i, name in enumerate(names):
        build(work, name, args.size_mb, 100 + i)
    print(
        f"\n{args.models} x {args.size_mb:g} MiB, room for {args.loaded} loaded,"
        f" {args.clients} clients, Zipf {args.zipf}, {args.duration:g} s each:"
    )
    runs = {
        "on": ("warm tier on", {"warm_tier_budget_mb": int(args.warm_mb)}),
        "unparked": ("warm tier on, no parked workers",
                     {"warm_tier_budget_mb": int(args.warm_mb), "warm_tier_parked_workers": 0}),
        "off": ("warm tier off", {}),
    }  # fmt: skip
    for run in args.runs.split(","):
        zipf_run(args, work, *runs[run], names)


def cost(args: argparse.Namespace, work: Path) -> None:
    names = [f"c{i:02d}" for i in range(args.models)]
    print(f"building {args.models} models, alternately {args.size_mb:g} and"
          f" {args.size_mb / args.ratio:g} MiB ...", flush=True)  # fmt: skip
    for i, name in enumerate(names):
        build(work, name, args.size_mb if i % 2 == 0 else args.size_mb / args.ratio, 200 + i)
    print(f"\n{args.models} models, alternately {args.size_mb:g} / {args.size_mb / args.ratio:g}"
          f" MiB, room for {args.loaded} loaded, warm tier {args.warm_mb:g} MiB,"
          f" {args.duration:g} s each:")  # fmt: skip
    on = {"warm_tier_budget_mb": int(args.warm_mb)}
    by_cost = zipf_run(args, work, "eviction cost", {**on, "eviction": "cost"}, names)
    by_lru = zipf_run(args, work, "eviction lru", {**on, "eviction": "lru"}, names)
    print(
        f"  seconds loading: cost {by_cost['load_s']:.1f} vs lru {by_lru['load_s']:.1f}"
        f" (requests {by_cost['requests']} vs {by_lru['requests']})"
    )
    for run in (by_cost, by_lru):
        kinds = [0.0, 0.0]  # loads of the expensive models (even), of the cheap ones (odd)
        for model, n in run["loads_by_model"].items():
            kinds[names.index(model) % 2] += n
        print(f"  {run['label']}: loads of expensive models {kinds[0]:g}, cheap {kinds[1]:g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("single", "wake", "steps", "zipf", "cost"))
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", type=int, default=24)
    parser.add_argument("--loaded", type=int, default=4)
    parser.add_argument("--warm-mb", type=float, default=8192)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--duration", type=float, default=120)
    parser.add_argument("--ratio", type=float, default=8, help="cost: expensive / cheap size")
    parser.add_argument("--runs", default="on,unparked,off",
                        help="zipf: which runs, in order (on, unparked, off)")  # fmt: skip
    parser.add_argument("--work", help="a folder to build in (default: a temporary one)")
    args = parser.parse_args()
    run = {"single": single, "wake": wake, "steps": steps, "zipf": zipf, "cost": cost}[args.mode]
    if args.work:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        run(args, work)
        return
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
        run(args, Path(tmp))


if __name__ == "__main__":
    main()
