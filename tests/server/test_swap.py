"""In-place swap (docs/rollouts.md, In-place swap): version A replaced by B one worker at a time
under a memory budget that fits two workers, while clients keep asking. Real servers, real
workers (exec'd, so each worker's PSS stands alone), real clients; one server for the module."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from server.top_data import Reader
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

pytestmark = pytest.mark.timeout(180)
FOLDER = HANDLERS / "swap_versions"
MIB = 2**20


def _start(root: Path, name: str, settings: dict) -> Server:
    # each worker a process of its own: its PSS is its own
    config = server_settings(root / "store", fork_workers=False, **settings)
    return start_daemon(root / f"{name}.yaml", root / name, config)


def _stop(server: Server) -> None:
    if pid_alive(server.pid):
        server.cli("--stop")


def _workers_pss(server: Server) -> list[int]:
    """The PSS of every process under the server (its workers), read from /proc."""
    sizes = []
    for proc in psutil.Process(server.pid).children(recursive=True):
        try:
            sizes.append(proc.memory_full_info().pss)
        except psutil.Error:
            continue
    return sizes


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, int, int]]:
    """A server whose budget fits two workers and not three; model m at 1.0 (2 workers), 2.0
    and 3.0 (cannot load) registered with none. Yields (server, budget, one worker's PSS)."""
    root = tmp_path_factory.mktemp("swap")
    store = root / "store"
    store.mkdir()
    for version, handler in (("1.0", "swapper:handle"), ("2.0", "swapper:handle"),
                             ("3.0", "broken:handle")):  # fmt: skip
        out = subprocess.run(
            [ARCHIVER_SCRIPT, "--model-name", "m", "--handler", handler, "--model-path",
             str(FOLDER), "--export-path", str(store), "--version", version, "-f"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        (store / "m.mar").rename(store / f"m-{version}.mar")
    probe = _start(root, "probe", {})
    try:
        assert probe.manage("POST", "/models?url=m-1.0.mar&initial_workers=1").status == 200
        one = max(_workers_pss(probe))
    finally:
        _stop(probe)
    budget_mb = int(one * 2.5 / MIB) + 1  # room for two workers, not three
    server = _start(root, "main", {"worker_memory_budget_mb": budget_mb, "load_wait_s": 2})
    try:
        reply = server.manage("POST", "/models?url=m-1.0.mar&initial_workers=2")
        assert reply.status == 200, reply.body
        for version in ("2.0", "3.0"):
            reply = server.manage("POST", f"/models?url=m-{version}.mar&initial_workers=0")
            assert reply.status == 200, reply.body
        yield server, budget_mb * MIB, one
    finally:
        _stop(server)


def _described(server: Server, version: str) -> dict:
    return server.manage("GET", f"/models/m/{version}").json()[0]


def _canary(server: Server, body: dict) -> dict:
    url = server.url("management", "/models/m/canary")
    return http("POST", url, json.dumps(body).encode(), {"Content-Type": "application/json"}).json()


def _metric(server: Server, pattern: str) -> float:
    text = http("GET", server.url("metrics", "/metrics")).body.decode()
    found = re.search(rf"^{pattern} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


class Load:
    """Clients asking for m by name (no version) until stopped, and a sampler of the workers'
    PSS from /proc, each on a thread of its own."""

    def __init__(self, server: Server, clients: int = 4) -> None:
        self.server = server
        self.answers: list[tuple[int, str]] = []
        self.peak_bytes = 0
        self.biggest_worker = 0
        self.fewest_ready = 1 << 30  # workers ready or busy, all versions, as describe lists them
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._ask) for _ in range(clients)]
        self._threads.append(threading.Thread(target=self._sample))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        wait_until(lambda: len(self.answers) >= 8, 30, "the first answers")
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _ask(self) -> None:
        while not self._stop.is_set():
            reply = self.server.predict("m", {"sleep": 0.01})
            version = reply.json().get("version", "") if reply.status == 200 else ""
            self.answers.append((reply.status, version if version else reply.body.decode()))

    def _sample(self) -> None:
        while not self._stop.is_set():
            sizes = _workers_pss(self.server)
            self.peak_bytes = max(self.peak_bytes, sum(sizes))
            self.biggest_worker = max([self.biggest_worker, *sizes])
            versions = self.server.manage("GET", "/models/m/all").json()
            ready = [w for v in versions for w in v["workers"] if w["state"] in ("READY", "BUSY")]
            self.fewest_ready = min(self.fewest_ready, len(ready))
            time.sleep(0.02)

    def failures(self) -> list[tuple[int, str]]:
        return [a for a in self.answers if a[0] != 200]


def test_bad_swaps_are_refused_naming_the_field(served: tuple[Server, int, int]) -> None:
    server, _budget, _one = served
    cases = {
        "/models/m/1.0/swap": "parameter 'to' is required: the version of m to swap 1.0 for",
        "/models/m/1.0/swap?to=9.9": (
            "parameter 'to': version '9.9' is not registered for model m (registered: 1.0, 2.0,"
            " 3.0); register it first (with initial_workers=0)"
        ),
        "/models/m/1.0/swap?to=1.0": (
            "parameter 'to': '1.0' is the version being swapped out; name another version"
        ),
        "/models/m/7.0/swap?to=2.0": (
            "version '7.0' (the path's) is not registered for model m (registered: 1.0, 2.0, 3.0)"
        ),
        "/models/m/1.0/swap?to=2.0&workers=0": "parameter 'workers' should be >= 1, found 0",
        "/models/m/1.0/swap?to=2.0&workers=x": "parameter 'workers' should be an integer, found 'x'",
    }
    for path, message in cases.items():
        reply = server.manage("PUT", path)
        assert (reply.status, reply.json()["message"]) == (400, message), path
    assert server.manage("PUT", "/models/nope/1.0/swap?to=2.0").status == 404
    # a canary moves the same traffic: one at a time (the other way round in the next test)
    canary = _canary(server, {"version": "2.0", "steps": [5, 100], "interval_s": 3600})
    assert canary["state"] == "running", canary
    refused = server.manage("PUT", "/models/m/1.0/swap?to=2.0").json()
    assert (refused["code"], refused["message"]) == (
        400, "model m: a canary of version 2.0 is running (running); promote or abort it before"
        " swapping its versions",
    )  # fmt: skip
    assert server.manage("PUT", "/models/m/canary/abort").status == 200
    assert server.manage("DELETE", "/models/m/canary").status == 200
    assert server.manage("GET", "/models/m/1.0/swap").status == 405
    assert "swap" not in _described(server, "1.0")  # none ran
    assert len(_described(server, "1.0")["workers"]) == 2


def test_swap_under_load_fails_no_request_and_keeps_to_the_budget(
    served: tuple[Server, int, int],
) -> None:
    server, budget, one = served
    release = server.run_dir / "scratch" / "m-1.0" / "release"  # the worker's TMPDIR
    held: list[dict] = []
    holder = threading.Thread(
        target=lambda: held.append(server.predict("m", {"hold": "release"}, version="1.0").json())
    )
    holder.start()  # one of A's workers stays busy until released: the swap cannot end before,
    # whichever of A's workers it drains first
    wait_until(lambda: any(w["state"] == "BUSY" for w in _described(server, "1.0")["workers"]),
               30, "1.0's worker busy")  # fmt: skip
    with Load(server) as load:
        started = server.manage("PUT", "/models/m/1.0/swap?to=2.0")
        assert started.status == 202, started.body
        assert started.json()["status"].startswith("Swapping model m from 1.0 to 2.0 (2 worker")
        # while it runs: one swap at a time, and its versions are the swap's to scale or remove
        again = server.manage("PUT", "/models/m/1.0/swap?to=2.0").json()
        assert again["code"] == 400
        assert again["message"].startswith("model m: a swap from 1.0 to 2.0 is already running (")
        scaled = server.manage("PUT", "/models/m/1.0?min_worker=3").json()
        assert scaled["message"].startswith(
            "model m version 1.0 cannot be scaled while a swap from 1.0 to 2.0 runs ("
        )
        canary = _canary(server, {"version": "2.0"})
        assert canary["code"] == 400
        assert canary["message"].startswith("model m: a swap from 1.0 to 2.0 is running (")
        removed = server.manage("DELETE", "/models/m/2.0").json()
        assert (
            removed["code"] == 400 and "cannot be unregistered while a swap" in removed["message"]
        )
        progress = _described(server, "1.0")["swap"]
        assert (progress["from"], progress["to"], progress["state"]) == ("1.0", "2.0", "running")
        top = Reader(server.status).read().models[0]  # what ``mserve top`` shows
        assert top.state.endswith(" (swapping)")
        assert top.swap.startswith("swap 1.0 -> 2.0 running: ")
        release.touch()
        wait_until(lambda: _described(server, "2.0")["swap"]["state"] != "running", 60,
                   "the swap to end")  # fmt: skip
        done_at = len(load.answers)
        wait_until(lambda: len(load.answers) >= done_at + 8, 30, "answers after the swap")
    assert held and held[0]["version"] == "1.0"  # the drained worker finished what it held
    assert load.failures() == []
    served_by = [v for _s, v in load.answers]
    assert served_by[0] == "1.0" and served_by[-1] == "2.0" and set(served_by) == {"1.0", "2.0"}

    swap = _described(server, "2.0")["swap"]
    assert (swap["state"], swap["reason"], swap["workers"]) == ("done", None, {"1.0": 0, "2.0": 2})
    assert swap["budgetBytes"] == budget
    assert 0 < swap["peakMemoryBytes"] <= budget + one  # the server's own accounting
    assert load.peak_bytes <= budget + load.biggest_worker  # /proc's
    steps = "\n".join(swap["steps"])
    assert "drained worker" in steps and "started worker 2 of m:2.0" in steps
    assert "2.0 is now the default version of m" in steps
    assert _metric(server, re.escape('mserve_model_swaps_total{model="m",outcome="done"}')) == 1
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert "model m: swapping m:1.0 (2 worker(s)) for m:2.0 (2 worker(s)) under a budget of" in log
    assert re.search(r"model m: drained worker \d+ of m:1\.0 in [\d.]+ s \(1 left\)", log)
    assert re.search(r"model m: swap done in [\d.]+ s", log)
    assert server.manage("GET", "/models").json()["models"][0]["modelUrl"] == "m-2.0.mar"
    a = _described(server, "1.0")
    assert (a["minWorkers"], a["workers"]) == (0, [])  # still registered, with no worker
    snapshot = json.loads((server.run_dir / "snapshot.json").read_text())
    saved = {(m["version"], m["min_workers"], m["default"]) for m in snapshot["models"]}
    assert saved == {("1.0", 0, False), ("2.0", 2, True), ("3.0", 0, False)}


def test_a_version_that_cannot_load_rolls_the_swap_back(served: tuple[Server, int, int]) -> None:
    server, _budget, _one = served
    assert len(_described(server, "2.0")["workers"]) == 2  # the test before swapped to it
    with Load(server) as load:
        reply = server.manage("PUT", "/models/m/2.0/swap?to=3.0&synchronous=true")
        done_at = len(load.answers)
        wait_until(lambda: len(load.answers) >= done_at + 8, 30, "answers after the rollback")
    assert reply.status == 400, reply.body
    message = reply.json()["message"]
    assert message.startswith("swap of model m from 2.0 to 3.0 rolled back: "), message
    assert "this version cannot load its weights" in message
    assert load.failures() == []
    assert {v for _s, v in load.answers[done_at:]} == {"2.0"}
    swap = _described(server, "2.0")["swap"]
    assert (swap["state"], swap["workers"]) == ("rolled back", {"2.0": 2, "3.0": 0})
    assert "this version cannot load its weights" in swap["reason"]
    assert "rolling back to m:2.0" in "\n".join(swap["steps"])
    assert _described(server, "3.0")["minWorkers"] == 0
    outcome = 'mserve_model_swaps_total{model="m",outcome="rolled_back"}'
    assert _metric(server, re.escape(outcome)) == 1
    listed = server.manage("GET", "/models").json()["models"][0]
    assert listed["modelUrl"] == "m-2.0.mar"  # still the default


def test_overlap_starts_each_new_worker_before_draining_one(
    served: tuple[Server, int, int],
) -> None:
    """``overlap=true``: B's worker starts before A's drains, so the ready workers never fall
    below two; the budget is passed by that one worker meanwhile, never more."""
    server, budget, one = served
    with Load(server) as load:
        reply = server.manage("PUT", "/models/m/2.0/swap?to=1.0&overlap=true&synchronous=true")
        done_at = len(load.answers)
        wait_until(lambda: len(load.answers) >= done_at + 8, 30, "answers after the swap")
    assert (reply.status, reply.json()["status"]) == (
        200, "Model m swapped from 2.0 to 1.0: 2 worker(s) of 1.0 serve, and 1.0 is the default"
        " version",
    )  # fmt: skip
    assert load.failures() == []
    assert load.fewest_ready >= 2  # no dip in capacity
    swap = _described(server, "1.0")["swap"]
    assert (swap["state"], swap["overlap"], swap["workers"]) == ("done", True, {"2.0": 0, "1.0": 2})
    assert budget < swap["peakMemoryBytes"] <= budget + one  # passed by one worker, no more
    assert load.peak_bytes <= budget + load.biggest_worker
    assert "(the budget passed by it until m:2.0's next worker is drained)" in swap["steps"][1]


def test_a_version_being_unregistered_is_not_swapped(served: tuple[Server, int, int]) -> None:
    server, _budget, _one = served
    release = server.run_dir / "scratch" / "m-1.0" / "release-2"  # "release" is there
    holder = threading.Thread(
        target=lambda: server.predict("m", {"hold": "release-2"}, version="1.0")
    )
    holder.start()
    wait_until(lambda: any(w["state"] == "BUSY" for w in _described(server, "1.0")["workers"]),
               30, "1.0's worker busy")  # fmt: skip
    deleted: list[int] = []
    deleter = threading.Thread(
        target=lambda: deleted.append(server.manage("DELETE", "/models/m/1.0").status)
    )
    deleter.start()  # its busy worker finishes first: the version is being unregistered
    wait_until(lambda: _described(server, "1.0")["workers"] == [], 30, "1.0 stopping")
    refused = server.manage("PUT", "/models/m/2.0/swap?to=1.0").json()
    assert (refused["code"], refused["message"]) == (
        400, "model m:1.0 is being unregistered: it cannot be swapped"
    )  # fmt: skip
    release.touch()
    holder.join(60)
    deleter.join(60)
    assert deleted == [200]


def test_a_swap_interrupted_by_a_kill_resumes_at_the_next_start(
    served: tuple[Server, int, int],
) -> None:
    """The snapshot is saved after each step: kill -9 mid-swap, start again, and the swap goes
    on from the worker counts it kept, to the same end (1.0 unregistered, as asked)."""
    server, _budget, _one = served
    assert server.manage("POST", "/models?url=m-1.0.mar&initial_workers=2").status == 200
    assert server.manage("PUT", "/models/m/1.0/set-default").status == 200

    def hold() -> None:
        with contextlib.suppress(OSError):  # the kill below answers it with a closed connection
            server.predict("m", {"hold": "never"}, version="1.0")

    holder = threading.Thread(target=hold)
    holder.start()  # the drain of A's busy worker never ends: the swap stops mid-way
    wait_until(lambda: any(w["state"] == "BUSY" for w in _described(server, "1.0")["workers"]),
               30, "1.0's worker busy")  # fmt: skip
    assert server.manage("PUT", "/models/m/1.0/swap?to=2.0&unregister=true").status == 202
    wait_until(lambda: "draining a worker of m:1.0" in _described(server, "1.0")["swap"]["step"],
               30, "a drain")  # fmt: skip
    os.kill(server.pid, signal.SIGKILL)
    holder.join(60)
    wait_until(lambda: not pid_alive(server.pid), 10, "the server to die")

    out = subprocess.run([MSERVE, "--start", *server.cli_args], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    again = Server(server.run_dir, json.loads((server.run_dir / "status.json").read_text()),
                   server.cli_args)  # fmt: skip
    try:
        wait_until(lambda: _described(again, "2.0")["swap"]["state"] != "running", 60,
                   "the resumed swap to end")  # fmt: skip
        swap = _described(again, "2.0")["swap"]
        assert (swap["state"], swap["workers"]) == ("done", {"1.0": 0, "2.0": 2})
        assert again.manage("GET", "/models").json()["models"][0]["modelUrl"] == "m-2.0.mar"
        assert again.predict("m", {}).json()["version"] == "2.0"
        assert "unregistered m:1.0" in swap["steps"][-2]  # unregister=true, kept by the snapshot
        assert again.manage("GET", "/models/m/1.0").status == 404
        log = (again.run_dir / "logs" / "mserve.log").read_text()
        assert "resuming the swap of m from 1.0 to 2.0 interrupted by the stop" in log
    finally:
        _stop(again)
