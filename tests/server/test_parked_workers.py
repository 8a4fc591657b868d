"""Parked workers (docs/warm-tier.md): an evicted model's idle worker kept alive without its
weights' pages, woken instead of a new worker started. One real server, real torch workers,
real weights files (8 MiB, from fixed seeds, test_warm_tier.py's archives) and /proc."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.server.conftest import Server, http, pid_alive, server_settings, start_daemon, wait_until
from tests.server.test_warm_tier import _archive, _ask, _described, _register, _tier

pytestmark = pytest.mark.timeout(240)
MIB = 2**20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("parked")
    store = root / "store"
    store.mkdir()
    for name, seed in (("a", 1), ("b", 2), ("c", 3), ("r", 4)):
        _archive(store, name, seed)
    _archive(store, "inplace", 5, config={"handler": {"write_in_place": True}})
    _archive(store, "slowpark", 6, config={"handler": {"park_sleep_s": 1.0}})
    settings = server_settings(
        store, warm_tier_budget_mb=1024, max_loaded_models=1, warm_tier_parked_workers=1
    )
    served = start_daemon(root / "mserve.yaml", root / "run", settings, timeout_s=300)
    for name in ("a", "b", "c", "r", "inplace", "slowpark"):
        _register(served, name)  # no idle unload: loads evict each other (room for one)
    yield served
    if pid_alive(served.pid):
        served.cli("--stop")


def _parked(server: Server, name: str) -> bool:
    return _described(server, name)["footprint"]["parked"]


# what the server logs of a park's end: parked, refused, handed to a request, failed, lost
_PARK_ENDS = ("parked in", "is not kept parked", "serves the request", "is not parked",
              "was lost while parking")  # fmt: skip


def _parks_settled(server: Server) -> bool:
    """Every eviction that parks a worker has ended (slowpark's takes a second: one still
    under way would take the one place after it was freed, and a park that follows would be
    refused for it)."""
    log = _log(server)
    started = log.count("parking or stopping 1 idle worker")
    ended = sum(1 for line in log.splitlines() if any(end in line for end in _PARK_ENDS))
    return ended >= started


def _free_the_place(server: Server) -> None:
    """No worker parked: which one holds the one place depends on the models' measured worth
    (request rate x cold load time); a hot reload of its model stops it (tested below)."""
    wait_until(lambda: _parks_settled(server), 15, "the parks under way ended")
    for name in ("a", "b", "c", "r", "inplace", "slowpark"):
        if _parked(server, name):
            assert server.manage("PUT", f"/models/{name}/reload").status == 200
    wait_until(lambda: _metric(server, "mserve_warm_tier_parked_workers") == 0, 15, "no parked")


def _weights_rss(pid: int) -> int:
    """The worker's resident bytes of its mapped weights file (/proc/<pid>/smaps)."""
    maps = psutil.Process(pid).memory_maps(grouped=True)
    return sum(m.rss for m in maps if m.path.endswith("/weights.pt"))


def _metric(server: Server, name: str) -> float:
    text = http("GET", server.url("metrics", "/metrics")).body.decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _log(server: Server) -> str:
    return (server.run_dir / "logs" / "mserve.log").read_text(errors="replace")


def test_an_evicted_worker_is_parked_and_woken_answers_the_same(server: Server) -> None:
    loaded = _ask(server, "a")
    pid = loaded["pid"]
    _ask(server, "b")  # room for one model: a is evicted
    wait_until(lambda: _parked(server, "a"), 15, "a's worker parked")
    assert _tier(server, "a") == "warm" and pid_alive(pid)
    # parked: the process lives on with its weights mapped (page cache the tier holds: a wake
    # faults nothing in); the tier's budget counts it (its PSS less its share of the weights,
    # which the tier counts once; PSS moves as processes come and go: bounds, not equality)
    assert _weights_rss(pid) > 7 * MIB
    assert _metric(server, "mserve_warm_tier_parked_workers") == 1
    parked_cost = _metric(server, "mserve_warm_tier_bytes") - 8 * MIB
    pss = psutil.Process(pid).memory_full_info().pss
    assert 0.5 * pss < parked_cost < 1.5 * pss, (parked_cost, pss)
    wakes = 'mserve_model_wakes_total{model="a",tier="warm",version="1.0"}'
    before = _metric(server, wakes)
    woken = _ask(server, "a")
    # the same worker, its handler as it was, the same answer
    assert (woken["pid"], woken["digest"], woken["mapped"]) == (pid, loaded["digest"], True)
    assert _metric(server, wakes) == before + 1
    assert not _parked(server, "a") and _tier(server, "a") == "loaded"
    assert "(woken from the warm tier: its parked worker)" in _log(server)


def test_at_most_the_configured_number_of_workers_is_parked(server: Server) -> None:
    seen = {}
    for name in ("a", "b", "c", "a", "c"):
        seen[name] = _ask(server, name)["pid"]
        parked = [n for n in ("a", "b", "c") if _parked(server, n)]
        assert len(parked) <= 1, parked
    # each model's worker, once the next one evicted it: one parked, the others stopped
    time.sleep(0.5)
    alive = [n for n, pid in seen.items() if pid_alive(pid)]
    assert len(alive) <= 2, alive  # c serves; one of the others may be parked
    assert _metric(server, "mserve_warm_tier_parked_workers") <= 1


def test_a_handler_that_wrote_to_its_mapped_weights_wakes_with_its_writes(
    server: Server,
) -> None:
    loaded = _ask(server, "inplace")  # its first layer scaled in place once loaded
    _free_the_place(server)
    _ask(server, "b")  # evicts it
    wait_until(lambda: _parked(server, "inplace"), 15, "inplace's worker parked")
    woken = _ask(server, "inplace")
    assert (woken["pid"], woken["digest"]) == (loaded["pid"], loaded["digest"])


def test_a_request_arriving_while_its_worker_is_being_parked_is_served_by_that_worker(
    server: Server,
) -> None:
    loaded = _ask(server, "slowpark")  # its worker takes a second to park
    _ask(server, "b")  # evicts slowpark: its worker is being parked
    asked = time.monotonic()
    again = _ask(server, "slowpark")  # within that second
    assert time.monotonic() - asked < 1.9  # it waited for the park, not for a new worker
    assert (again["pid"], again["digest"]) == (loaded["pid"], loaded["digest"])
    assert "serves the request that asked for it meanwhile" in _log(server)


def test_a_parked_worker_is_never_woken_stale(server: Server) -> None:
    other = _ask(server, "c")  # what seed 3's weights answer
    loaded = _ask(server, "r")
    _free_the_place(server)
    _ask(server, "b")  # evicts r, whose worker takes the free place
    wait_until(lambda: _parked(server, "r"), 15, "r's worker parked")
    # its code reloaded (PUT .../reload): the parked worker holds the old code, so it goes
    assert server.manage("PUT", "/models/r/reload").status == 200
    wait_until(lambda: not pid_alive(loaded["pid"]), 15, "r's parked worker stopped")
    assert _tier(server, "r") == "warm"  # its weights stay warm
    reloaded = _ask(server, "r")  # a new worker (b's is parked now)
    assert reloaded["pid"] != loaded["pid"] and reloaded["digest"] == loaded["digest"]
    _ask(server, "b")  # b's parked worker woken, r's parked in its place
    wait_until(lambda: _parked(server, "r"), 15, "r's new worker parked")
    # its weights file replaced (a new inode): the parked worker maps the old file
    target = Path(reloaded["model_dir"]) / "weights.pt"
    fresh = target.with_name("weights.new")
    fresh.write_bytes((Path(other["model_dir"]) / "weights.pt").read_bytes())
    fresh.replace(target)
    woken = _ask(server, "r")
    assert woken["pid"] != reloaded["pid"] and woken["digest"] == other["digest"]
    wait_until(lambda: not pid_alive(reloaded["pid"]), 15, "the stale parked worker stopped")


def test_parked_workers_stop_with_the_server(server: Server) -> None:
    loaded = _ask(server, "r")
    _free_the_place(server)
    _ask(server, "b")
    wait_until(lambda: _parked(server, "r"), 15, "r's worker parked")
    assert server.cli("--stop").returncode == 0
    wait_until(lambda: not pid_alive(loaded["pid"]), 15, "the parked worker gone")
