"""The warm tier, measured footprints and eviction by cost (docs/warm-tier.md): one real server,
real torch workers, real weights files (8 MiB, made from fixed seeds) and real archives. Its
workers are not parked, so each wake starts a new one; parked workers: test_parked_workers.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from tests.conftest import ARCHIVER_SCRIPT
from tests.server.conftest import (
    HANDLERS,
    MSERVE,
    Server,
    http,
    pid_alive,
    server_settings,
    start_daemon,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)
FOLDER = HANDLERS / "warm_weights"
MIB = 2**20
WARM_BUDGET_MB = 20  # two of the 8 MiB models, not three
WORKER_BUDGET_MB = 250


def _weights(path: Path, seed: int, legacy: bool = False) -> Path:
    import sys

    sys.path.insert(0, str(FOLDER))
    try:
        from stack import Stack
    finally:
        sys.path.remove(str(FOLDER))
    torch.manual_seed(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(Stack().state_dict(), path, _use_new_zipfile_serialization=not legacy)
    return path


class _Payload:
    """What a checkpoint that runs a command when unpickled holds."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _archive(store: Path, name: str, seed: int, handler: str = "handler.py",
             config: dict | None = None, legacy: bool = False) -> None:  # fmt: skip
    work = store.parent / f"src-{name}"
    weights = _weights(work / "weights.pt", seed, legacy)
    if name == "payload":
        state = {"w": _Payload(store.parent / "payload-ran")}
        torch.save(state, weights, _use_new_zipfile_serialization=False)
    args = [
        ARCHIVER_SCRIPT, "--model-name", name, "--handler", str(FOLDER / handler),
        "--model-file", str(FOLDER / "stack.py"), "--serialized-file", str(weights),
        "--export-path", str(store), "--archive-format", "zip-store", "-f",
    ]  # fmt: skip
    if handler != "handler.py":
        args[args.index("--model-file") : args.index("--model-file")] = [
            "--extra-files", str(FOLDER / "stack.py"),
        ]  # fmt: skip
    if config is not None:
        cfg = work / "model-config.yaml"
        cfg.write_text(yaml.safe_dump(config))
        args += ["-c", str(cfg)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def _start(root: Path) -> Server:
    settings = server_settings(
        root / "store", warm_tier_budget_mb=WARM_BUDGET_MB,
        worker_memory_budget_mb=WORKER_BUDGET_MB, max_loaded_models=2,
        warm_tier_parked_workers=0,  # a wake starts a worker here (test_parked_workers.py)
    )  # fmt: skip
    return start_daemon(root / "mserve.yaml", root / "run", settings, timeout_s=300)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("warm")
    store = root / "store"
    store.mkdir()
    for name, seed in (("a", 1), ("b", 2), ("c", 3), ("d", 4)):
        _archive(store, name, seed)
    _archive(store, "custom", 1, handler="custom.py")
    _archive(store, "cheap", 5)
    _archive(store, "dear", 6, config={"handler": {"load_sleep_s": 1.5}})
    _archive(store, "e", 8)
    _archive(store, "legacy", 9, legacy=True)
    _archive(store, "payload", 9, legacy=True)
    served = _start(root)
    yield served
    if pid_alive(served.pid):
        served.cli("--stop")


def _register(server: Server, name: str, idle_s: int = 0) -> None:
    reply = server.manage(
        "POST",
        f"/models?url={name}.mar&model_name={name}&initial_workers=0&idle_unload_timeout={idle_s}",
    )
    assert reply.status == 200, reply.body


def _ask(server: Server, name: str, seed: int = 7) -> dict:
    reply = server.predict(name, {"seed": seed})
    assert reply.status == 200, reply.body
    return reply.json()


def _described(server: Server, name: str) -> dict:
    return server.manage("GET", f"/models/{name}").json()[0]


def _tier(server: Server, name: str) -> str:
    return _described(server, name)["footprint"]["tier"]


def _metric(server: Server, pattern: str) -> float:
    text = http("GET", server.url("metrics", "/metrics")).body.decode()
    found = re.search(rf"^{pattern} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _server_maps(server: Server, path_part: str) -> int:
    """The server process's resident bytes of mapped files whose path holds ``path_part``
    (/proc/<pid>/smaps)."""
    maps = psutil.Process(server.pid).memory_maps(grouped=True)
    return sum(m.rss for m in maps if path_part in m.path)


def _unload(server: Server, name: str) -> None:
    """Wait for ``name`` (registered with an idle unload) to go warm or cold."""
    wait_until(lambda: _tier(server, name) != "loaded", 30, f"{name} unloaded")


def test_a_worker_footprint_is_measured_against_proc(
    server: Server,
) -> None:
    _register(server, "a", idle_s=0)
    answer = _ask(server, "a")
    assert answer["mapped"] is True  # BaseHandler's loading, unchanged, mapped the weights
    pid = answer["pid"]
    wait_until(
        lambda: _described(server, "a")["footprint"]["workerPssBytes"] is not None, 15,
        "a's footprint",
    )  # fmt: skip
    shown = _described(server, "a")["footprint"]
    pss = psutil.Process(pid).memory_full_info().pss
    assert abs(shown["workerPssBytes"] - pss) < 0.25 * pss, (shown, pss)
    assert shown["tier"] == "loaded" and shown["coldLoadSeconds"] > 0
    assert (
        server.manage("PUT", "/models/a?min_worker=0&max_worker=1&synchronous=true").status == 200
    )
    saved = server.run_dir / "footprints.json"  # written by the residency chore (1 s)

    def kept() -> int:
        known = json.loads(saved.read_text())["models"] if saved.exists() else {}
        return (known.get("a:1.0") or {}).get("worker_bytes") or 0

    wait_until(lambda: kept() > 0, 15, "a's footprint in the file")
    # scaled to 0 by hand, it goes warm as an idle unload would
    wait_until(lambda: _tier(server, "a") == "warm", 15, "a warm")


def test_a_model_woken_from_warm_answers_exactly_what_it_answered_loaded(server: Server) -> None:
    _register(server, "b", idle_s=1)
    loaded = _ask(server, "b")
    _unload(server, "b")
    wait_until(lambda: _tier(server, "b") == "warm", 15, "b warm")
    weights = Path(loaded["model_dir"]) / "weights.pt"
    size = weights.stat().st_size
    # the warm tier's pages, as the server's own mapping holds them in /proc
    wait_until(lambda: _server_maps(server, str(weights)) > 0.9 * size, 15, "b's pages mapped")
    wait_until(lambda: (_described(server, "b")["footprint"]["warmBytes"] or 0) > 0.9 * size, 15)
    wakes = 'mserve_model_wakes_total{model="b",tier="warm",version="1.0"}'
    assert _metric(server, re.escape(wakes)) == 0
    woken = _ask(server, "b")
    assert woken["pid"] != loaded["pid"] and woken["mapped"] is True
    assert woken["digest"] == loaded["digest"]
    assert _metric(server, re.escape(wakes)) == 1
    assert _tier(server, "b") == "loaded"
    assert _described(server, "b")["footprint"]["warmWakeSeconds"] > 0


def test_a_handler_calling_the_helper_gets_the_warm_tier_too(server: Server) -> None:
    _register(server, "custom", idle_s=1)
    loaded = _ask(server, "custom")
    assert loaded["mapped"] is True
    _unload(server, "custom")
    wait_until(lambda: _tier(server, "custom") == "warm", 15, "custom warm")
    woken = _ask(server, "custom")
    assert (woken["digest"], woken["mapped"]) == (loaded["digest"], True)
    assert woken["pid"] != loaded["pid"]


def test_a_changed_weights_file_is_never_woken_stale(server: Server) -> None:
    _register(server, "c", idle_s=1)
    _register(server, "d", idle_s=1)
    other = _ask(server, "d")  # what seed 4's weights answer
    _unload(server, "d")
    # c goes warm last: a model entering the tier is kept and others dropped to fit it, so
    # d's entry, had it come after, could have dropped c's
    old = _ask(server, "c")
    assert other["digest"] != old["digest"]
    _unload(server, "c")
    wait_until(lambda: _tier(server, "c") == "warm", 15, "c warm")
    # the file under c's unpacked archive replaced by d's weights (a new inode)
    target = Path(old["model_dir"]) / "weights.pt"
    fresh = target.with_name("weights.new")
    fresh.write_bytes((Path(other["model_dir"]) / "weights.pt").read_bytes())
    fresh.replace(target)
    assert _tier(server, "c") == "cold"  # its identity no longer matches
    woken = _ask(server, "c")
    assert woken["digest"] == other["digest"] != old["digest"]
    stale = 'mserve_warm_tier_drops_total{model="c",reason="stale",version="1.0"}'
    assert _metric(server, re.escape(stale)) == 1
    cold = 'mserve_model_wakes_total{model="c",tier="cold",version="1.0"}'
    assert _metric(server, re.escape(cold)) == 2


def _workers_pss(server: Server) -> int:
    """The PSS of the server's workers (forked by its templates: its grandchildren), from /proc."""
    total = 0
    for template in psutil.Process(server.pid).children():
        for worker in template.children():
            try:
                total += worker.memory_full_info().pss
            except psutil.Error:
                continue
    return total


def test_the_budgets_hold_and_drops_to_cold_are_counted(server: Server) -> None:
    names = ("b", "c", "d", "custom")  # registered above, idle unload after 1 s
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(_workers_pss(server))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for _round in range(2):
            for name in names:  # no wait: the budgets evict
                _ask(server, name)
                # the server's mappings of weights files (page cache, /proc) within the tier
                held = _server_maps(server, "weights.pt")
                assert held <= WARM_BUDGET_MB * MIB, held
    finally:
        stop.set()
        sampler.join()
    # While the loop runs, evictions by the worker budget may keep only two models out of
    # workers, which the warm tier holds; once all four idle out (1 s), each has entered the
    # tier, which holds two: the others were dropped to cold by its budget.
    wait_until(lambda: all(_tier(server, n) != "loaded" for n in names), 30, "all idle")
    tiers = {n: _tier(server, n) for n in names}
    assert sum(tier == "warm" for tier in tiers.values()) <= 2, tiers
    budget = r'mserve_warm_tier_drops_total\{model="\w+",reason="budget",version="1.0"\}'
    text = http("GET", server.url("metrics", "/metrics")).body.decode()
    drops = [line for line in text.splitlines() if line.startswith("mserve_warm_tier_drops")]
    assert sum(float(v) for v in re.findall(rf"^{budget} (\S+)$", text, re.M)) >= 1, drops
    one = max(_described(server, n)["footprint"]["workerPssBytes"] or 0 for n in names)
    assert max(samples) <= WORKER_BUDGET_MB * MIB + one, (max(samples), one)


def test_eviction_by_cost_evicts_the_cheap_model_first(server: Server) -> None:
    wait_until(lambda: _metric(server, "mserve_models_loaded") == 0, 30, "others unloaded")
    _register(server, "cheap")
    _register(server, "dear")
    # cheap is asked for a little more often, and more recently: plain LRU would evict dear
    for _ in range(3):
        _ask(server, "dear")
    for _ in range(4):
        _ask(server, "cheap")
    described = _described(server, "dear")["footprint"]
    assert (
        described["coldLoadSeconds"] > _described(server, "cheap")["footprint"]["coldLoadSeconds"]
    )
    # "a" (test 1) loads on demand: max_loaded_models=2, one of them goes
    _ask(server, "a")
    assert _tier(server, "dear") == "loaded"
    assert _tier(server, "cheap") in ("warm", "cold")


def test_top_shows_each_model_tier_footprint_and_wake_time(server: Server) -> None:
    env = {**os.environ, "COLUMNS": "200"}
    out = subprocess.run([MSERVE, "top", "--once", "--run-dir", str(server.run_dir)],
                         capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.rstrip() for line in out.stdout.splitlines() if line.strip()}
    assert "warm tier" in out.stdout and f"of {WARM_BUDGET_MB} MiB" in out.stdout
    assert rows["dear"].split()[-3:-2] == ["loaded"]
    assert rows["b"].split()[-3] in ("warm", "cold") and rows["b"].endswith(" s")


def _wakes(server: Server, name: str, tier: str) -> float:
    return _metric(
        server, re.escape(f'mserve_model_wakes_total{{model="{name}",tier="{tier}",version="1.0"}}')
    )


def test_a_model_scaled_to_0_by_hand_goes_warm_and_a_scale_from_0_is_a_wake(
    server: Server,
) -> None:
    _register(server, "e")  # no idle unload: only the scale requests below unload it
    to_0 = "/models/e?min_worker=0&max_worker=1&synchronous=true"
    up = "/models/e?min_worker=1&max_worker=1&synchronous=true"
    # never loaded: brought up by a scale request, a cold wake, counted as a load on demand's
    assert server.manage("PUT", up).status == 200
    assert (_wakes(server, "e", "cold"), _wakes(server, "e", "warm")) == (1, 0)
    assert _described(server, "e")["footprint"]["coldLoadSeconds"] > 0
    loaded = _ask(server, "e")
    assert server.manage("PUT", to_0).status == 200
    wait_until(lambda: _tier(server, "e") == "warm", 15, "e warm after a scale to 0")
    weights = str(Path(loaded["model_dir"]) / "weights.pt")
    wait_until(lambda: _server_maps(server, weights) > 0, 15, "e's pages mapped")
    assert _described(server, "e")["footprint"]["warmWakeSeconds"] is None
    # woken from warm by a scale request: counted and timed as a wake on demand would be
    assert server.manage("PUT", up).status == 200
    assert (_wakes(server, "e", "cold"), _wakes(server, "e", "warm")) == (1, 1)
    assert _described(server, "e")["footprint"]["warmWakeSeconds"] > 0
    scaled = _ask(server, "e")
    assert scaled["pid"] != loaded["pid"] and scaled["digest"] == loaded["digest"]
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert re.search(r"model e:1\.0 scaled up from 0 workers: ready in \S+ s \(cold\)", log)
    assert re.search(r"e:1\.0 scaled up from 0 workers: ready in \S+ s \(woken from the warm", log)
    assert server.manage("PUT", to_0).status == 200
    wait_until(lambda: _server_maps(server, weights) > 0, 15, "e warm again")
    woken = _ask(server, "e")  # a load on demand, from the warm tier
    assert woken["pid"] != scaled["pid"] and woken["digest"] == loaded["digest"]
    assert (_wakes(server, "e", "cold"), _wakes(server, "e", "warm")) == (1, 2)
    assert server.manage("PUT", to_0).status == 200
    wait_until(lambda: _server_maps(server, weights) > 0, 15, "e warm again")
    assert server.manage("DELETE", "/models/e").status == 200
    dropped = 'mserve_warm_tier_drops_total{model="e",reason="unregistered",version="1.0"}'
    assert _metric(server, re.escape(dropped)) == 1  # at once, not at the chore's next pass
    assert _server_maps(server, weights) == 0


def _conversions(server: Server) -> int:
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    return log.count("to a mappable copy, once")


def test_a_legacy_checkpoint_is_converted_once_and_mapped_thereafter(server: Server) -> None:
    _register(server, "legacy", idle_s=1)
    loaded = _ask(server, "legacy")
    assert loaded["mapped"] is True  # its mappable copy, made by the worker
    source = Path(loaded["model_dir"]) / "weights.pt"
    assert source.read_bytes()[:2] == b"\x80\x02"  # the archive's file stays as it was
    folder = server.run_dir / "unpacked" / "legacy-1.0.mapped"
    copies = list(folder.iterdir())
    assert [p.name.split(".")[:2] for p in copies] == [["weights", "pt"]], copies
    assert _conversions(server) == 1
    _unload(server, "legacy")
    wait_until(lambda: _server_maps(server, str(copies[0])) > 0, 15, "the copy kept warm")
    woken = _ask(server, "legacy")
    assert (woken["digest"], woken["mapped"]) == (loaded["digest"], True)
    assert _conversions(server) == 1  # mapped, not converted again
    assert (_wakes(server, "legacy", "cold"), _wakes(server, "legacy", "warm")) == (1, 1)
    # the source replaced (another file, same bytes): converted again, the old copy gone
    fresh = source.with_name("weights.new")
    fresh.write_bytes(source.read_bytes())
    fresh.replace(source)
    _unload(server, "legacy")
    wait_until(lambda: _server_maps(server, str(copies[0])) > 0, 15, "the old copy kept warm")
    again = _ask(server, "legacy")
    assert (again["digest"], again["mapped"]) == (loaded["digest"], True)
    assert _conversions(server) == 2
    # its weights were read and converted again, not mapped from the tier: a cold load
    assert (_wakes(server, "legacy", "cold"), _wakes(server, "legacy", "warm")) == (2, 1)
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert "model legacy:1.0 loaded on demand in" in log
    assert len(re.findall(r"model legacy:1\.0 loaded on demand in \S+ s \(cold\)", log)) == 2
    assert ", a legacy checkpoint converted " in log  # the worker's ready line
    assert len(list(folder.iterdir())) == 1 and not copies[0].exists()
    assert server.manage("DELETE", "/models/legacy").status == 200
    assert not folder.exists()


def test_a_legacy_checkpoint_that_would_run_code_is_refused_not_converted(
    server: Server,
) -> None:
    _register(server, "payload")
    reply = server.predict("payload", {"seed": 7})
    assert reply.status >= 500, reply.body
    assert b"is not a plain state dict" in reply.body
    assert not (server.run_dir.parent / "payload-ran").exists()  # no process unpickled it
    assert not list((server.run_dir / "unpacked" / "payload-1.0.mapped").iterdir())
