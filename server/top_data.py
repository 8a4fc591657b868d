"""What ``mserve top`` shows, read from a running server: its status file, the management API
(with the key file's management key) and the metrics port; rates are the difference between two
reads a few seconds apart, as ``top`` does with its counters."""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

RATE_WINDOW_S = 5.0  # requests/s, errors and p50/p99 over about the last five seconds


@dataclass
class WorkerRow:
    id: str
    state: str
    pid: int | None
    cpu_percent: float | None
    memory_bytes: int | None


@dataclass
class VersionRow:
    version: str
    status: str  # READY, LOADING, FAILED
    load_state: str  # loaded, loading, unloaded
    min_workers: int
    max_workers: int
    queue: int
    failure: str | None
    workers: list[WorkerRow]
    # measured footprint (describe's footprint, server/models/footprints.py): loaded, warm
    # or cold; a worker's PSS; its weights in the warm tier; its last cold load and warm wake
    tier: str = ""
    worker_bytes: int | None = None
    warm_bytes: int | None = None
    load_s: float | None = None
    wake_s: float | None = None


@dataclass
class ModelRow:
    name: str
    versions: list[VersionRow]
    requests_per_s: float = 0.0
    errors: int = 0  # answers other than 2xx since the server started
    p50_s: float | None = None
    p99_s: float | None = None
    evictions: int = 0
    swap: str = ""  # its in-place swap, running or the last one (describe's swap)
    traffic: str = ""  # its split and canary (describe's traffic, server/rollouts/)
    tenants: str = ""  # what each tenant was served and refused (server/tenants/), if any

    @property
    def state(self) -> str:
        states = {_state(v) for v in self.versions}
        canary = " (canary)" if "canary" in self.traffic and " running" in self.traffic else ""
        return (
            ", ".join(sorted(states)) + (" (swapping)" if " running" in self.swap else "") + canary
        )

    @property
    def queue(self) -> int:
        return sum(v.queue for v in self.versions)

    @property
    def tier(self) -> str:
        return ", ".join(sorted({v.tier for v in self.versions if v.tier})) or "-"

    @property
    def wake_s(self) -> float | None:
        """What bringing its slowest version back took last: a warm wake, else a cold load."""
        times = [v.wake_s if v.wake_s is not None else v.load_s for v in self.versions]
        known = [t for t in times if t is not None]
        return max(known) if known else None

    @property
    def workers(self) -> list[WorkerRow]:
        return [w for v in self.versions for w in v.workers]

    @property
    def memory_bytes(self) -> int:
        return sum(w.memory_bytes or 0 for w in self.workers)


def _state(v: VersionRow) -> str:
    """As ``mserve --status`` says it: ready, unloaded, loading or failed."""
    if v.status == "READY":
        return "ready" if v.load_state == "loaded" else v.load_state
    return v.status.lower()


@dataclass
class Snapshot:
    status: dict[str, Any]
    models: list[ModelRow] = field(default_factory=list)
    memory_bytes: float | None = None
    budget_bytes: float | None = None
    warm_bytes: float | None = None  # the warm tier (server/models/warm.py), when on
    warm_budget_bytes: float | None = None
    error: str | None = None  # the last read failed: why (the rows are the last good ones)

    @property
    def uptime_s(self) -> float:
        return time.time() - float(self.status.get("started") or time.time())


class Reader:
    """Reads the server once per :meth:`read`; keeps the counters of the last few reads."""

    def __init__(self, status: dict[str, Any], client: httpx.Client | None = None) -> None:
        self.status = status
        headers = {}
        key_file = status.get("key_file")
        if status.get("token_authorization") and key_file:
            key = json.loads(Path(key_file).read_text())["management"]["key"]
            headers["Authorization"] = f"Bearer {key}"
        self.client = client or httpx.Client(headers=headers, timeout=5.0)
        # (when, {model: (requests, latency bucket counts)}) of recent reads
        self._history: deque[tuple[float, dict[str, tuple[float, dict[float, float]]]]] = deque()
        self._procs: dict[int, psutil.Process] = {}
        self._last: Snapshot | None = None
        self._swaps: dict[str, str] = {}  # model: its swap, as _versions read it
        self._traffic: dict[str, str] = {}  # model: its traffic policy, as _versions read it

    def close(self) -> None:
        self.client.close()

    def read(self) -> Snapshot:
        try:
            snap = self._read()
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            last = self._last or Snapshot(self.status)
            return Snapshot(last.status, last.models, last.memory_bytes, last.budget_bytes,
                            f"cannot read the server: {exc}")  # fmt: skip
        self._last = snap
        return snap

    def _get(self, api: str, path: str) -> httpx.Response:
        reply = self.client.get(self.status["urls"][api] + path)
        reply.raise_for_status()
        return reply

    def _read(self) -> Snapshot:
        names, token = [], ""
        while True:  # TorchServe's paging
            page = self._get("management", f"/models?limit=100{token}").json()
            names += [m["modelName"] for m in page.get("models", ())]
            if not page.get("nextPageToken"):
                break
            token = f"&next_page_token={page['nextPageToken']}"
        rows = [
            ModelRow(name, self._versions(name), swap=self._swaps.pop(name, ""),
                     traffic=self._traffic.pop(name, ""))
            for name in names
        ]  # fmt: skip
        snap = Snapshot(self.status, rows)
        self._add_metrics(snap, self._get("metrics", "/metrics").text)
        return snap

    def _versions(self, name: str) -> list[VersionRow]:
        versions = []
        for d in self._get("management", f"/models/{name}/all").json():
            self._swaps[name] = swap_line(d.get("swap"))
            self._traffic[name] = traffic_line(d.get("traffic"))
            workers = [
                WorkerRow(
                    w["id"],
                    w.get("state") or w["status"],
                    w.get("pid"),
                    self._cpu(w.get("pid")),
                    w.get("memoryUsage"),
                )
                for w in d.get("workers") or ()
            ]
            footprint = d.get("footprint") or {}
            versions.append(VersionRow(
                str(d.get("modelVersion")), d.get("status", ""), d.get("loadState", ""),
                int(d.get("minWorkers") or 0), int(d.get("maxWorkers") or 0),
                int(d.get("queueDepth") or 0), d.get("failure"), workers,
                footprint.get("tier") or "", footprint.get("workerPssBytes"),
                footprint.get("warmBytes"), footprint.get("coldLoadSeconds"),
                footprint.get("warmWakeSeconds"),
            ))  # fmt: skip
        return versions

    def _cpu(self, pid: int | None) -> float | None:
        """A worker's CPU use since the last read (psutil, as top; the server is local)."""
        if pid is None:
            return None
        proc = self._procs.get(pid)
        try:
            if proc is None:
                proc = self._procs[pid] = psutil.Process(pid)
                proc.cpu_percent(None)  # the first call only starts the count
                return None
            return proc.cpu_percent(None)
        except psutil.Error:
            self._procs.pop(pid, None)
            return None

    def _add_metrics(self, snap: Snapshot, text: str) -> None:
        counts: dict[str, tuple[float, dict[float, float]]] = {}
        errors: dict[str, float] = {}
        evictions: dict[str, float] = {}
        # model: {tenant: [served, refused]} (server/tenants/)
        tenants: dict[str, dict[str, list[float]]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                model = s.labels.get("model", "")
                if s.name == "mserve_requests_total":
                    total, buckets = counts.get(model, (0.0, {}))
                    counts[model] = (total + s.value, buckets)
                    if not s.labels.get("code", "").startswith("2"):
                        errors[model] = errors.get(model, 0.0) + s.value
                elif s.name == "mserve_request_latency_seconds_bucket":
                    total, buckets = counts.setdefault(model, (0.0, {}))
                    buckets[float(s.labels["le"])] = s.value
                elif s.name in _TENANT_COUNTS:
                    tenant = tenants.setdefault(model, {}).setdefault(s.labels["tenant"], [0, 0])
                    tenant[_TENANT_COUNTS[s.name]] += s.value
                elif s.name == "mserve_model_evictions_total":
                    evictions[model] = evictions.get(model, 0.0) + s.value
                elif s.name == "mserve_worker_memory_bytes":
                    snap.memory_bytes = s.value
                elif s.name == "mserve_worker_memory_budget_bytes":
                    snap.budget_bytes = s.value
                elif s.name == "mserve_warm_tier_bytes":
                    snap.warm_bytes = s.value
                elif s.name == "mserve_warm_tier_budget_bytes":
                    snap.warm_budget_bytes = s.value
        now = time.monotonic()
        self._history.append((now, counts))
        while len(self._history) > 2 and now - self._history[1][0] >= RATE_WINDOW_S:
            self._history.popleft()
        then, before = self._history[0]
        for row in snap.models:
            row.errors = int(errors.get(row.name, 0))
            row.tenants = tenants_line(tenants.get(row.name))
            row.evictions = int(evictions.get(row.name, 0))
            total, buckets = counts.get(row.name, (0.0, {}))
            old_total, old_buckets = before.get(row.name, (0.0, {}))
            if now > then:
                row.requests_per_s = max(0.0, total - old_total) / (now - then)
            window = {le: n - old_buckets.get(le, 0.0) for le, n in buckets.items()}
            if not any(window.values()):
                window = buckets  # nothing answered lately: since the start
            row.p50_s, row.p99_s = quantile(window, 0.5), quantile(window, 0.99)


_TENANT_COUNTS = {
    "mserve_tenant_requests_served_total": 0,
    "mserve_tenant_requests_refused_total": 1,
}


def tenants_line(counts: dict[str, list[float]] | None) -> str:
    """``tenants: heavy 2753 (75%), light 919 (25%), capped 2 (0%) 1 refused``: each tenant's
    requests served since the start, its share of them, and its refusals (over quota)."""
    if not counts:
        return ""
    total = sum(served for served, _refused in counts.values()) or 1
    words = []
    for name, (served, refused) in sorted(counts.items(), key=lambda kv: -kv[1][0]):
        word = f"{name} {served:.0f} ({100 * served / total:.0f}%)"
        words.append(word + (f" {refused:.0f} refused" if refused else ""))
    return "tenants: " + ", ".join(words)


def swap_line(swap: dict[str, Any] | None) -> str:
    """describe's ``swap`` in a line: ``swap 1.0 -> 2.0 running: starting worker 2 of m:2.0
    (1.0: 1, 2.0: 1 workers)``, or how the last one ended."""
    if not swap:
        return ""
    line = f"swap {swap.get('from')} -> {swap.get('to')} {swap.get('state')}"
    if swap.get("state") == "running":
        line += f": {swap.get('step')}"
    elif swap.get("reason"):
        line += f": {swap.get('reason')}"
    workers = swap.get("workers")
    if workers:
        line += " (" + ", ".join(f"{v}: {n}" for v, n in workers.items()) + " workers)"
    return line


def traffic_line(traffic: dict[str, Any] | None) -> str:
    """describe's ``traffic`` in a line: ``split 1.0 95% 2.0 5% (served 1.0 94.8% 2.0 5.2%),
    sticky by header x-user; canary 2.0 running at 5% (step 1 of 4)``, or how it ended; and
    the shadow's counts."""
    if not traffic:
        return ""
    split = " ".join(f"{v} {w:g}%" for v, w in (traffic.get("split") or {}).items())
    served = " ".join(
        f"{v} {s.get('share', 0) * 100:.1f}%" for v, s in (traffic.get("served") or {}).items()
    )
    line = f"split {split or 'default'}" + (f" (served {served})" if served else "")
    sticky = traffic.get("sticky")
    if sticky:
        line += ", sticky by " + " ".join(f"{k} {v}" for k, v in sticky.items())
    canary = traffic.get("canary")
    if canary:
        line += f"; canary {canary.get('version')} {canary.get('state')}"
        if canary.get("share") is not None:
            steps = canary.get("steps") or ()
            line += f" at {canary['share']:g}% (step {canary.get('step')} of {len(steps)})"
        elif canary.get("reason"):
            line += f": {canary['reason']}"
    shadow = traffic.get("shadow")
    if shadow:
        line += "; " + _shadow_words(shadow)
    return line


def _shadow_words(shadow: dict[str, Any]) -> str:
    """``shadow 2.0 100%: 312 equal, 4 different (number), 0 dropped; p50 11.2 / 8.9 ms``
    (server/rollouts/shadow.py's shown(): the primary's p50, then the shadow's)."""
    settings = shadow.get("settings") or {}
    counts = shadow.get("counts") or {}
    kinds = ", ".join(shadow.get("differences") or {})
    words = (
        f"shadow {settings.get('version')} {settings.get('share', 0):g}%:"
        f" {counts.get('equal', 0)} equal, {counts.get('different', 0)} different"
        + (f" ({kinds})" if kinds else "")
        + f", {counts.get('dropped', 0)} dropped"
    )
    latency = shadow.get("latency_ms") or {}
    p50s = [(latency.get(k) or {}).get("p50") for k in ("primary", "shadow")]
    if None not in p50s:
        words += f"; p50 {p50s[0]:.1f} / {p50s[1]:.1f} ms"
    return words


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of cumulative histogram buckets (upper bound: count), interpolated in
    its bucket as Prometheus's ``histogram_quantile`` does; None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower  # beyond the last finite bound: that bound, as Prometheus says
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower
