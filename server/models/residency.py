"""Many models on one server: which models keep workers.

A model with no worker loads on demand (server/models/version.py: a request starts one). This module
decides the rest, server-wide:

- **Idle unload**: a model asked for nothing during its ``idle_unload_s`` scales down to its
  ``min_workers`` (0 unloads it; the next request loads it again).
- **Budget**: before a worker is started (on demand, or by a scale request or a registration
  through :meth:`ModelVersion.scale`), the workers' memory (PSS, which splits the
  pages a forked worker shares with its template; RSS where there is no PSS) plus what a worker
  of that model took last time must fit ``worker_memory_budget_mb``, and the models with
  workers must stay within ``max_loaded_models``. If not, the least recently used idle model
  (another one, every worker ready and none busy, nothing queued) is scaled down to its
  ``min_workers`` and the check runs again; with nothing to evict the start waits for room up to
  ``load_wait_s``, then fails with :class:`BudgetExhausted`, which names the budget. Workers
  that are stopping count as gone: the new worker does not wait for them to exit (tens of ms,
  more on a busy machine), so for that long the real memory can pass the budget by theirs.

Starts are admitted one at a time (a lock), so two cannot both take the last room. A scale
request raises the model's ``min_workers`` before it waits for admission, so evictions leave
the workers it asked for alone (they only ever stop workers beyond ``min_workers``). A
worker that serves is never stopped here: :meth:`ModelVersion.unload` refuses a model with a
busy or starting worker or queued requests, and nothing awaits between that check and the stop
signal. A request arriving while its model is being evicted finds no worker and starts one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import psutil

from server.config import ServerConfig
from server.config.model_settings import ModelSettings
from server.errors import BudgetExhausted
from server.metrics.server_metrics import Metrics

log = logging.getLogger(__name__)

MEASURE_EVERY_S = 5.0  # the memory gauge, when nothing else measured it meanwhile
# A worker's PSS is read again only when older than this: reading it walks the process's page
# tables (milliseconds for a worker that imported torch), so re-reading every worker at each
# admission would slow each load on demand down. A new worker is read at once.
REREAD_AFTER_S = MEASURE_EVERY_S
MIB = 2**20


class Resident(Protocol):
    """A model version as residency sees it (server/models/version.py's ModelVersion, which
    imports this module: the dependency runs one way)."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def label(self) -> str: ...
    @property
    def settings(self) -> ModelSettings: ...
    def live_workers(self, retiring: bool = True) -> list[tuple[int | None, bool]]: ...
    def idle_since(self) -> float | None: ...
    def unload(self, why: str) -> list[asyncio.Task[None]]: ...


class Residency:
    def __init__(self, config: ServerConfig, metrics: Metrics | None = None) -> None:
        mb = config.worker_memory_budget_mb
        self.budget_bytes: int | None = mb * MIB if mb is not None else None
        self.max_loaded = config.max_loaded_models
        self.wait_s = config.load_wait_s
        self.metrics = metrics
        self.memory_bytes = 0  # the workers' memory when last measured
        self.leaving_bytes = 0  # of which: workers stopping (evicted or scaled down)
        self.peak_bytes = 0
        self.loads = 0
        self.failed_loads = 0
        self.evictions = 0
        self._models: Callable[[], Sequence[Resident]] = list
        self._lock = asyncio.Lock()
        self._per_worker: dict[str, int] = {}  # model label: a ready worker's memory, last seen
        self._measured_at = 0.0
        self._sizes: dict[int, tuple[float, int]] = {}  # pid: (when read, bytes)

    def watch(self, models: Callable[[], Sequence[Resident]]) -> None:
        """Where the registered model versions are (the registry)."""
        self._models = models

    @property
    def limited(self) -> bool:
        return self.budget_bytes is not None or self.max_loaded is not None

    def loaded_models(self, but: Resident | None = None) -> int:
        """Models with a worker starting or serving (not one only stopping: it is unloaded),
        ``but`` left out."""
        return sum(1 for m in self._models() if m is not but and m.live_workers(retiring=False))

    # --- events -----------------------------------------------------------------------------

    def loaded(self, model: Resident, seconds: float, ok: bool) -> None:
        """An on-demand load ended (server/models/version.py)."""
        self.loads += 1
        self.failed_loads += not ok
        if self.metrics is not None:
            self.metrics.model_loaded(model.name, model.version, seconds, ok)

    def _evicted(self, model: Resident, reason: str) -> None:
        self.evictions += 1
        if self.metrics is not None:
            self.metrics.model_evicted(model.name, model.version, reason)

    # --- admission --------------------------------------------------------------------------

    async def admit(self, model: Resident, count: int = 1) -> None:
        """Return when ``count`` new workers of ``model`` may start: evict idle models until
        they fit, wait for room up to ``load_wait_s``; raise :class:`BudgetExhausted` past it.

        The caller must create the workers' slots before its next ``await``: the admission
        lock is released on return, and the next admission counts what it sees started."""
        if not self.limited:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        try:
            await asyncio.wait_for(self._lock.acquire(), self.wait_s)
        except asyncio.TimeoutError:
            why = "other loads held the budget"
            raise BudgetExhausted(self._refusal(model, count, why)) from None
        try:
            while True:
                why = await self._over(model, count)
                if why is None:
                    return
                victim = self._victim(model)
                if victim is not None and victim.unload(f"evicted for {model.label}: {why}"):
                    # no wait for its workers to exit (tens of ms, more on a busy machine):
                    # the check below leaves their memory out already
                    self._evicted(victim, "budget")
                    continue
                if loop.time() >= deadline:
                    raise BudgetExhausted(self._refusal(model, count, why))
                await asyncio.sleep(0.1)
        finally:
            self._lock.release()

    def _refusal(self, model: Resident, count: int, why: str) -> str:
        what = (
            f"load model {model.label}"
            if count == 1
            else (f"start {count} workers of model {model.label}")
        )
        return (
            f"cannot {what}: {why}, and no idle model could be unloaded"
            f" within load_wait_s={self.wait_s:g}"
        )

    async def _over(self, model: Resident, count: int = 1) -> str | None:
        """Why ``count`` new workers of ``model`` do not fit now, or None when they do."""
        if self.max_loaded is not None and not model.live_workers(retiring=False):
            loaded = self.loaded_models(but=model)
            if loaded >= self.max_loaded:
                return f"max_loaded_models={self.max_loaded} models have workers"
        if self.budget_bytes is None:
            return None
        used = await self.measure() - self.leaving_bytes
        each = self._estimate(model)
        if used + count * each <= self.budget_bytes:
            return None
        takes = (
            f"a worker of {model.label} takes"
            if count == 1
            else (f"{count} workers of {model.label} take")
        )
        return (
            f"worker_memory_budget_mb={self.budget_bytes // MIB}: workers use"
            f" {used / MIB:.0f} MiB and {takes} about {count * each / MIB:.0f} MiB"
        )

    def _victim(self, model: Resident) -> Resident | None:
        """The least recently used model that could be unloaded now, other than ``model``."""
        best: tuple[float, Resident] | None = None
        for m in self._models():
            since = m.idle_since() if m is not model else None
            if since is not None and (best is None or since < best[0]):
                best = (since, m)
        return best[1] if best else None

    def _estimate(self, model: Resident) -> int:
        """A worker of ``model`` takes what its last one took; never seen: the mean of all."""
        known = self._per_worker.get(model.label)
        if known is not None:
            return known
        if self._per_worker:
            return sum(self._per_worker.values()) // len(self._per_worker)
        return 0

    async def measure(self) -> int:
        """The workers' memory now: each one's PSS (a starting one counts what a worker of its
        model took last time, if more), read again when older than ``REREAD_AFTER_S``."""
        models = self._models()
        workers = [(m, pid, starting) for m in models for pid, starting in m.live_workers()]
        staying = {pid for m in models for pid, _s in m.live_workers(retiring=False)}
        now = time.monotonic()
        live = {pid for _m, pid, _s in workers if pid}
        starting = {pid for _m, pid, s in workers if pid and s}  # still growing: never cached
        stale = [
            pid for pid in live
            if pid in starting or pid not in self._sizes
            or now - self._sizes[pid][0] >= REREAD_AFTER_S
        ]  # fmt: skip
        read = await asyncio.to_thread(_memory_of, stale) if stale else {}
        self._sizes = {pid: v for pid, v in self._sizes.items() if pid in live}
        self._sizes.update((pid, (now, size)) for pid, size in read.items())
        sizes = {pid: size for pid, (_t, size) in self._sizes.items()}
        for pid in starting:
            self._sizes.pop(pid, None)
        used = leaving = 0
        for m, pid, starting in workers:
            size = sizes.get(pid, 0) if pid else 0
            if starting:
                size = max(size, self._estimate(m))
            elif size and pid in staying:
                self._per_worker[m.label] = size
            used += size
            if pid not in staying:
                leaving += size
        self.memory_bytes = used
        self.leaving_bytes = leaving
        self.peak_bytes = max(self.peak_bytes, used)
        self._measured_at = now
        return used

    # --- idle unload ------------------------------------------------------------------------

    def unload_idle(self, now: float) -> None:
        for m in self._models():
            idle_s = m.settings.idle_unload_s
            if not idle_s:
                continue
            since = m.idle_since()
            if since is not None and now - since >= idle_s and m.unload(f"idle for {idle_s:g} s"):
                self._evicted(m, "idle")

    async def run(self) -> None:
        """The server's chore: idle unloads (checked at a quarter of the shortest
        ``idle_unload_s``, between 0.05 and 1 s) and the memory gauge."""
        while True:
            now = time.monotonic()
            try:
                self.unload_idle(now)
            except Exception:  # the chore's guard: one bad pass must not end idle unloads
                log.exception("unexpected error unloading idle models")
            if now - self._measured_at >= MEASURE_EVERY_S:
                try:
                    await self.measure()
                except (OSError, psutil.Error) as exc:
                    log.warning("could not measure the workers' memory: %s", exc)
            idle = [m.settings.idle_unload_s for m in self._models() if m.settings.idle_unload_s]
            await asyncio.sleep(min(1.0, max(0.05, min(idle) / 4)) if idle else 1.0)


def _memory_of(pids: list[int]) -> dict[int, int]:
    """Each process's PSS where the platform has it (Linux), else RSS; gone ones left out."""
    out = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            try:
                out[pid] = int(proc.memory_full_info().pss)
            except (AttributeError, psutil.AccessDenied):
                out[pid] = int(proc.memory_info().rss)
        except psutil.Error:
            continue
    return out
