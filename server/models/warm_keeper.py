"""Residency's side of the warm tier: what it keeps there, and when.

The tier itself (warm.py) maps files within a budget and knows nothing of models. Residency
(residency.py) decides which models keep workers. This module sits between them: an evicted
model's mapped files go into the tier (measured, in a task of its own), an unregistered
model's leave it with its mappable copies, a model's tier is told for describe, what keeping a
model warm is worth (its request rate x its cold load time) ranks the tier's drops, drops are
counted in the metrics, and the residency chore's pass measures the tier and, once a minute
after the start, sweeps the copies of models no longer registered. A model that had no worker
and has one ready again (a load on demand, or a scale from 0) is counted as a wake, warm or
cold as its worker's weights really came.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from mserve_worker.protocol import PARK
from server.errors import WorkerDied
from server.metrics.server_metrics import Metrics
from server.models.eviction import DEFAULT_RELOAD_S, Rates
from server.models.footprints import Footprints
from server.models.warm import WarmTier
from server.workers.process import Worker, WorkerState, memory_of

log = logging.getLogger(__name__)

MEASURE_EVERY_S = 5.0  # the tier's pages, read from /proc/self/smaps
SWEEP_COPIES_AFTER_S = 60.0  # after the start: the startup models are registered by then
MIB = 2**20
# what a wake's log line says of where its weights came from, by tier (scripts/bench_warm.py
# reads it); nothing with the warm tier off
SOURCES = {"warm": " (woken from the warm tier)", "cold": " (cold)"}
PARKED_SOURCE = " (woken from the warm tier: its parked worker)"
PARK_TIMEOUT_S = 30.0  # dropping a mapping's pages: milliseconds; past this the worker is killed


class Kept(Protocol):
    """A model version as the warm tier's keeper sees it (residency.py's Resident)."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def label(self) -> str: ...
    def live_workers(self, retiring: bool = True) -> list[tuple[int | None, bool]]: ...


class WarmKeeper:
    def __init__(
        self, tier: WarmTier, footprints: Footprints, rates: Rates, metrics: Metrics | None
    ) -> None:
        self.tier = tier
        self.footprints = footprints
        self.metrics = metrics
        self._rates = rates
        tier.on_drop = self._dropped
        self._keeping: set[asyncio.Task[int]] = set()  # keeps under way
        self._measured_at = 0.0
        self._sweep_at: float | None = None  # set at the chore's first pass
        self.on_woken: Callable[[], None] | None = None  # a worker to measure (residency)

    def keep(self, model: Kept, files: list[tuple[str, int]]) -> None:
        """``model``'s last workers are stopping (evicted, or scaled to 0 by hand): keep the
        ``files`` they mapped in the warm tier (what :meth:`Resident.mapped_files` said before
        they were retired)."""
        if files and self.tier.enabled:
            task = asyncio.get_running_loop().create_task(self._keep(model, files))
            self._keeping.add(task)
            task.add_done_callback(self._keeping.discard)

    async def forget(self, model: Kept) -> None:
        """``model`` was unregistered: its weights leave the warm tier now, and its mappable
        copies of legacy checkpoints go."""
        self.tier.drop(model.label, "unregistered")
        await self.tier.remove_copies(model.name, model.version)

    async def _keep(self, model: Kept, files: list[tuple[str, int]]) -> int:
        try:
            kept = await self.tier.keep(model.label, files, self._worth)
        except Exception:  # a task of its own: nothing else would see it
            log.exception("could not keep model %s warm", model.label)
            return 0
        if kept:
            self.footprints.warm(model.label, kept)
            log.info("model %s is warm: %.0f MiB of weights kept in the page cache",
                     model.label, kept / MIB)  # fmt: skip
        return kept

    def _dropped(self, label: str, reason: str) -> None:
        if self.metrics is not None:
            name, _, version = label.rpartition(":")
            self.metrics.warm_dropped(name, version, reason)

    async def park(self, model: Kept, worker: Worker) -> bool:
        """``model`` was evicted and its weights kept warm: park its idle ``worker`` there
        (it drops its pages of the weights and keeps its handler: mserve_worker/park.py), its
        PSS counted in the tier's budget. Whether it was kept; if not, the caller stops it."""
        tier = self.tier
        if (
            tier.max_parked <= 0 or not worker.parks or worker.gpu is not None
            or worker.state is not WorkerState.READY
        ):  # fmt: skip
            return False  # (whether its weights were kept is known after: see WarmTier.park)
        try:
            answer = await worker.park(PARK, PARK_TIMEOUT_S)
        except WorkerDied as exc:
            log.warning("model %s: worker %s was lost while parking: %s",
                        model.label, worker.id, exc.message)  # fmt: skip
            return False
        if not answer.ok:
            log.info("model %s: worker %s is not parked: %s", model.label, worker.id,
                     answer.error)  # fmt: skip
            return False
        pid = worker.pid
        pss = (await asyncio.to_thread(memory_of, [pid])).get(pid, 0) if pid else 0
        refused = tier.park(model.label, worker, pss, self._worth)
        if refused is not None:
            log.info("model %s: worker %s is not kept parked: %s", model.label, worker.id,
                     refused)  # fmt: skip
            return False
        log.info("model %s: worker %s parked in %.3f s: %.0f MiB of weights' pages let go,"
                 " %.0f MiB kept (its PSS)", model.label, worker.id, answer.seconds,
                 answer.bytes / MIB, pss / MIB)  # fmt: skip
        return True

    def woke(
        self, model: Kept, seconds: float, taken: list[str], mapped: list[tuple[str, int]],
        parked: bool = False,
    ) -> str:  # fmt: skip
        """``model`` had no worker and has one ready after ``seconds``: its wake or cold load
        time into its footprint, the wake counted by tier; the log's words for where its
        weights came from (:data:`SOURCES`). ``warm`` when its admission took files from the
        tier (``taken``) and its worker mapped every one of them (READY's ``mapped``): it
        used the kept pages. Otherwise ``cold``: a worker that converted a legacy checkpoint
        replaced in place (mserve_worker/sdk/convert.py) read and converted its weights
        again, and maps a new copy, not the one the tier held."""
        used = {path for path, _size in mapped}
        tier = "warm" if taken and used.issuperset(taken) else "cold"
        self.footprints.loaded(model.label, seconds, warm=tier == "warm")
        if self.metrics is not None:
            self.metrics.model_woken(model.name, model.version, tier)
        if self.on_woken is not None:
            self.on_woken()
        if not self.tier.enabled:
            return ""
        return PARKED_SOURCE if parked and tier == "warm" else SOURCES[tier]

    def wake(self, model: Kept, started: float, taken: list[str]) -> Callable[[Worker], None]:
        """A scale request brought ``model`` up from 0 workers (``PUT /models/{m}?min_worker=n``,
        an in-place swap's start; not a registration's first workers): it comes back as on a
        load on demand. What to call with each of its new workers ready: the first counts the
        wake from ``started`` (monotonic), with ``taken``, what its admission took."""
        counted = False

        def ready(worker: Worker) -> None:
            nonlocal counted
            if not counted:
                counted = True
                seconds = time.monotonic() - started
                source = self.woke(model, seconds, taken, worker.mapped, worker.wakes > 0)
                log.info("model %s scaled up from 0 workers: ready in %.2f s%s",
                         model.label, seconds, source)  # fmt: skip

        return ready

    def tier_of(self, model: Kept) -> str:
        """``loaded`` (workers starting or serving), ``warm`` (its weights in the warm tier)
        or ``cold``."""
        if model.live_workers(retiring=False):
            return "loaded"
        return "warm" if self.tier.holds(model.label) else "cold"

    def _worth(self, label: str) -> float:
        """What keeping ``label`` warm saves, per second: its rate x its cold load time."""
        load_s = self.footprints.get(label).load_s
        return self._rates.rate(label, time.monotonic()) * (load_s or DEFAULT_RELOAD_S)

    async def tend(self, models: Sequence[Kept], now: float) -> None:
        """The residency chore's pass: once, a minute after the start, the mappable copies of
        models no longer registered go (warm.py); every ``MEASURE_EVERY_S`` the tier's pages
        are measured into the footprints."""
        if self._sweep_at is None:
            self._sweep_at = now + SWEEP_COPIES_AFTER_S
        if self.tier.enabled and now >= self._sweep_at:
            self._sweep_at = float("inf")
            try:
                await self.tier.sweep_copies((m.name, m.version) for m in models)
            except OSError as exc:
                log.warning("could not sweep the mappable copies: %s", exc)
        if self.tier.entries and now - self._measured_at >= MEASURE_EVERY_S:
            self._measured_at = now
            self.tier.prune(m.label for m in models)
            await self.tier.measure()
            for label, entry in self.tier.entries.items():
                self.footprints.warm(label, entry.bytes)
