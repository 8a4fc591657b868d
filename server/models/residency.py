"""Many models on one server: which models keep workers.

A model with no worker loads on demand (server/models/version.py: a request starts one). This module
decides the rest, server-wide:

- **Idle unload**: a model asked for nothing during its ``idle_unload_s`` scales down to its
  ``min_workers`` (0 unloads it; the next request loads it again).
- **Budget**: before a worker is started (on demand, or by a scale request or a registration
  through :meth:`ModelVersion.scale`), the workers' memory (PSS, which splits the
  pages a forked worker shares with its template; RSS where there is no PSS) plus what a worker
  of that model took last time must fit ``worker_memory_budget_mb``, and the models with
  workers must stay within ``max_loaded_models``. If not, the idle model cheapest to evict
  (another one, every worker ready and none busy, nothing queued; eviction.py: request rate x
  measured reload time, or the least recently used with ``eviction: lru``) is scaled down to
  its ``min_workers`` (its mapped weights going to the warm tier: warm_keeper.py, warm.py) and
  the check runs again; with nothing to evict the start waits for room up to
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
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import psutil

from server.config import ServerConfig
from server.config.model_settings import ModelSettings
from server.errors import BudgetExhausted
from server.metrics.server_metrics import Metrics
from server.models.eviction import DEFAULT_RELOAD_S, Rates
from server.models.footprints import Footprints
from server.models.warm import Taken, WarmTier
from server.models.warm_keeper import Kept, WarmKeeper
from server.workers.process import Worker

log = logging.getLogger(__name__)

MEASURE_EVERY_S = 5.0  # the memory gauge, when nothing else measured it meanwhile
# A worker's PSS is read again only when older than this: reading it walks the process's page
# tables (milliseconds for a worker that imported torch), so re-reading every worker at each
# admission would slow each load on demand down. A new worker is read at once.
REREAD_AFTER_S = MEASURE_EVERY_S
MIB = 2**20
# With no idle model to evict, a start looks again this often: a model goes idle when its last
# batch is answered, and every poll past that moment is the waiting request's time (the check
# is a few comparisons; with a memory budget, cached PSS readings)
ROOM_POLL_S = 0.02
WAIT_LOGGED_S = 0.05  # an admission that waited longer says so in the log


class Resident(Kept, Protocol):
    """A model version as residency sees it (server/models/version.py's ModelVersion, which
    imports this module: the dependency runs one way): what the warm tier's keeper sees, and
    more."""

    @property
    def settings(self) -> ModelSettings: ...
    def idle_since(self) -> float | None: ...
    def unload(self, why: str, park: bool = False) -> list[asyncio.Task[None]]: ...
    def mapped_files(self) -> list[tuple[str, int]]: ...
    @property
    def asked(self) -> int: ...


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
        # model label: what its starts may pass the budget by (one_over, an in-place swap's)
        self._over_by: dict[str, int] = {}
        # what each model version was measured to take, kept across restarts (footprints.py)
        self.footprints = Footprints(config.run_path)
        # evicted models' weights kept in the page cache (warm.py); off without a budget
        warm_mb = config.warm_tier_budget_mb
        self.warm = WarmTier(
            warm_mb * MIB if warm_mb else None, config.run_path / "unpacked",
            config.warm_tier_parked_workers,
        )  # fmt: skip
        self.eviction = config.eviction  # "cost" or "lru" (see _victim)
        self._rates = Rates()
        # what goes into the warm tier and when (warm_keeper.py)
        self.keeper = WarmKeeper(self.warm, self.footprints, self._rates, metrics)
        self.keeper.on_woken = self._measure_soon
        self._keeping: set[asyncio.Task[int]] = set()  # measures under way
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

    def loaded(
        self, model: Resident, seconds: float, ok: bool, taken: list[str], worker: Worker | None
    ) -> str:
        """An on-demand load ended (server/models/version.py; ``taken``: what its admission
        took from the warm tier, ``worker``: the one it started); where its weights came from,
        for the log (warm_keeper.py's ``SOURCES``)."""
        self.loads += 1
        self.failed_loads += not ok
        if self.metrics is not None:
            self.metrics.model_loaded(model.name, model.version, seconds, ok)
        if not ok or worker is None:
            return ""
        return self.keeper.woke(model, seconds, taken, worker.mapped, worker.wakes > 0)

    def _measure_soon(self) -> None:
        """A worker of a model that had none is ready: its PSS into the footprint now,
        whatever the budget (a model unloaded before the chore's next reading would have
        none)."""
        task = asyncio.get_running_loop().create_task(self._measure_quietly())
        self._keeping.add(task)
        task.add_done_callback(self._keeping.discard)

    def _unload(self, model: Resident, why: str, reason: str) -> bool:
        """Evict ``model`` if it is idle (``reason``: ``idle`` or ``budget``); its mapped
        weights go to the warm tier. False when it could not be unloaded now."""
        files = model.mapped_files() if self.warm.enabled else []
        if not model.unload(why, park=bool(files)):
            return False
        self.evictions += 1
        if self.metrics is not None:
            self.metrics.model_evicted(model.name, model.version, reason)
        self.keep_warm(model, files, parking=True)
        return True

    def keep_warm(
        self, model: Resident, files: list[tuple[str, int]], parking: bool = False
    ) -> None:
        """``model``'s last workers are stopping: keep the ``files`` they mapped warm;
        ``parking``: its worker is about to be parked (warm_keeper.py)."""
        self.keeper.keep(model, files, parking)

    async def forget(self, model: Resident) -> None:
        """``model`` was unregistered: it leaves the warm tier, its mappable copies go."""
        await self.keeper.forget(model)

    async def _measure_quietly(self) -> int:
        try:
            return await self.measure()
        except (OSError, psutil.Error) as exc:
            log.warning("could not measure the workers' memory: %s", exc)
            return 0

    def shown(self, model: Resident) -> dict[str, float | int | None]:
        """describe's ``footprint``: its tier and what it was measured to take
        (footprints.py)."""
        entry = self.warm.entries.get(model.label)
        return {
            "tier": self.keeper.tier_of(model),
            # its last worker, parked in the warm tier: a wake needs no new worker
            "parked": entry is not None and entry.parked is not None,
            **self.footprints.get(model.label).shown(),
        }

    # --- admission --------------------------------------------------------------------------

    async def admit(self, model: Resident, count: int = 1) -> Taken:
        """:meth:`_admit`, then the model's weights leave the warm tier for its workers: the
        files taken (none when it was not warm), which the wake's count holds against what
        its worker mapped (warm_keeper.py), and its parked worker, woken instead of a new
        one started."""
        await self._admit(model, count)
        return self.warm.take(model.label) if self.warm.enabled else Taken()

    async def _admit(self, model: Resident, count: int = 1) -> None:
        """Return when ``count`` new workers of ``model`` may start: evict idle models until
        they fit, wait for room up to ``load_wait_s``; raise :class:`BudgetExhausted` past it.

        The caller must create the workers' slots before its next ``await``: the admission
        lock is released on return, and the next admission counts what it sees started."""
        if not self.limited:
            return
        loop = asyncio.get_running_loop()
        asked = loop.time()
        deadline = asked + self.wait_s
        try:
            await asyncio.wait_for(self._lock.acquire(), self.wait_s)
        except asyncio.TimeoutError:
            why = "other loads held the budget"
            raise BudgetExhausted(self._refusal(model, count, why)) from None
        in_line = loop.time() - asked  # behind other starts' admissions (and the loop's delays)
        waited_since, waited_for = None, ""  # when it first found no room, nothing to evict
        try:
            while True:
                why = await self._over(model, count)
                if why is None:
                    if waited_since is not None or in_line >= WAIT_LOGGED_S:
                        room = loop.time() - (waited_since or loop.time())
                        log.info("model %s: admitted after %.2f s in line and %.2f s waiting"
                                 " for room%s", model.label, in_line, room,
                                 f" ({waited_for})" if waited_for else "")  # fmt: skip
                    return
                victim = self._victim(model)
                if victim is not None and self._unload(
                    victim, f"evicted for {model.label}: {why}", "budget"
                ):
                    # no wait for its workers to exit (tens of ms, more on a busy machine):
                    # the check below leaves their memory out already
                    continue
                if loop.time() >= deadline:
                    raise BudgetExhausted(self._refusal(model, count, why))
                if waited_since is None:
                    waited_since, waited_for = loop.time(), why
                await asyncio.sleep(ROOM_POLL_S)
        finally:
            self._lock.release()

    async def fits(self, model: Resident, count: int = 1) -> bool:
        """Whether ``count`` new workers of ``model`` fit now, evicting nothing and waiting for
        nothing (an in-place swap, server/models/swap.py, drains a worker first when not)."""
        return not self.limited or await self._over(model, count) is None

    @contextlib.contextmanager
    def one_over(self, model: Resident) -> Iterator[None]:
        """Within this block a start of ``model`` may pass the budget by one worker of it: an
        in-place swap with ``overlap`` starts B's worker before A's is drained."""
        self._over_by[model.label] = self._estimate(model)
        try:
            yield
        finally:
            self._over_by.pop(model.label, None)

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
        if used + count * each <= self.budget_bytes + self._over_by.get(model.label, 0):
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
        """The model, other than ``model``, that could be unloaded now and costs least to
        evict (eviction.py: its request rate x what bringing it back takes; least recently
        used among equals), or the least recently used with ``eviction: lru``."""
        now = time.monotonic()
        models = self._models()
        if self.eviction == "cost":
            self._rates.sample(models, now)
        best: tuple[float, float, Resident] | None = None
        for m in models:
            since = m.idle_since() if m is not model else None
            if since is None:
                continue
            cost = self.eviction_cost(m, now) if self.eviction == "cost" else 0.0
            if best is None or (cost, since) < best[:2]:
                best = (cost, since, m)
        return best[2] if best else None

    def eviction_cost(self, model: Resident, now: float) -> float:
        """Seconds of loading per second that evicting ``model`` is expected to cost."""
        warm = self.warm.enabled and bool(model.mapped_files())
        reload_s = self.footprints.get(model.label).reload_s(warm)
        return self._rates.rate(model.label, now) * (reload_s or DEFAULT_RELOAD_S)

    def _estimate(self, model: Resident) -> int:
        """A worker of ``model`` takes what its last one took; never seen: the mean of all."""
        known = self.footprints.get(model.label).worker_bytes
        if known is not None:
            return known
        seen = self.footprints.known_worker_bytes()
        return sum(seen) // len(seen) if seen else 0

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
                self.footprints.worker(m.label, size)
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
            if since is not None and now - since >= idle_s:
                self._unload(m, f"idle for {idle_s:g} s", "idle")

    async def run(self) -> None:
        """The server's chore: idle unloads (checked at a quarter of the shortest
        ``idle_unload_s``, between 0.05 and 1 s), the memory gauge, and the warm tier's pass
        (warm_keeper.py)."""
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
            await self.footprints.save()  # when a figure changed
            self._rates.sample(self._models(), now)
            await self.keeper.tend(self._models(), now)
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
