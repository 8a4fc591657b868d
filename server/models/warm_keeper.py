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

from server.errors import WorkerDied
from server.metrics.server_metrics import Metrics
from server.models.eviction import DEFAULT_RELOAD_S, Rates
from server.models.footprints import Footprints
from server.models.warm import WarmEntry, WarmTier, parked_cost
from server.workers.process import Worker, WorkerState

log = logging.getLogger(__name__)

MEASURE_EVERY_S = 5.0  # the tier's pages, read from /proc/self/smaps
SWEEP_COPIES_AFTER_S = 60.0  # after the start: the startup models are registered by then
MIB = 2**20
# what a wake's log line says of where its weights came from, by tier (scripts/bench_warm.py
# reads it); nothing with the warm tier off
SOURCES = {"warm": " (woken from the warm tier)", "cold": " (cold)"}
PARKED_SOURCE = " (woken from the warm tier: its parked worker)"
PARKED_COST_GUESS = 64 * MIB  # a parked torch worker's PSS beside its weights, until read
PARK_TIMEOUT_S = 30.0  # a garbage collection and a heap trim: milliseconds; past this it is killed


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
        # what the last parked worker held beside its weights: a new one's first estimate
        self._parked_cost = PARKED_COST_GUESS

    def keep(self, model: Kept, files: list[tuple[str, int]], parking: bool = False) -> None:
        """``model``'s last workers are stopping (evicted, or scaled to 0 by hand): keep the
        ``files`` they mapped in the warm tier (what :meth:`Resident.mapped_files` said before
        they were retired), held now and mapped in a task; ``parking``: its last worker is
        about to be parked (:meth:`park`), which a wake meanwhile waits for."""
        if not files or not self.tier.enabled:
            return
        entry = self.tier.hold(model.label, files, self._worth, parking)
        if entry is not None:
            task = asyncio.get_running_loop().create_task(self._map(entry))
            self._keeping.add(task)
            task.add_done_callback(self._keeping.discard)

    async def forget(self, model: Kept) -> None:
        """``model`` was unregistered: its weights leave the warm tier now, and its mappable
        copies of legacy checkpoints go."""
        self.tier.drop(model.label, "unregistered")
        await self.tier.remove_copies(model.name, model.version)

    async def _map(self, entry: WarmEntry) -> int:
        try:
            kept = await self.tier.map(entry)
        except Exception:  # a task of its own: nothing else would see it
            log.exception("could not keep model %s warm", entry.label)
            return 0
        if kept:
            self.footprints.warm(entry.label, kept)
            log.info("model %s is warm: %.0f MiB of weights kept in the page cache",
                     entry.label, kept / MIB)  # fmt: skip
        return kept

    def _dropped(self, label: str, reason: str) -> None:
        if self.metrics is not None:
            name, _, version = label.rpartition(":")
            self.metrics.warm_dropped(name, version, reason)

    async def park(self, model: Kept, worker: Worker | None, allowed: bool = True) -> bool:
        """``model`` was evicted and its weights kept warm: park its idle ``worker`` there (it
        keeps its handler and its mapped weights: mserve_worker/park.py), what it holds beside
        the weights counted in the tier's budget, or hand it to a wake that asked for the
        model meanwhile. Whether it was kept; if not, the caller stops it (and a wake waiting
        for it starts a new one). ``allowed``: the model's workers may be parked at all (not
        under sequence batching, whose handler keeps each sequence's state)."""
        tier, label = self.tier, model.label
        kept = False
        try:
            if (
                not allowed or worker is None or tier.max_parked <= 0 or not worker.parks
                or worker.gpu is not None or worker.state is not WorkerState.READY
            ):  # fmt: skip
                return False
            try:
                answer = await worker.park(PARK_TIMEOUT_S)
            except WorkerDied as exc:
                log.warning("model %s: worker %s was lost while parking: %s",
                            label, worker.id, exc.message)  # fmt: skip
                return False
            if not answer.ok:
                log.info("model %s: worker %s is not parked: %s", label, worker.id, answer.error)
                return False
            if tier.hand_over(label, worker):  # asked for again while it was being parked
                log.info("model %s: worker %s, just parked, serves the request that asked for"
                         " it meanwhile", label, worker.id)  # fmt: skip
                kept = True
                return True
            # kept at once on what the last parked worker held (a request asked for it in the
            # meantime would wait for the reading: seconds, under load, behind other threads);
            # read now, and again with the tier every 5 s
            refused = tier.park(label, worker, self._parked_cost, self._worth)
            if refused is not None:
                log.info("model %s: worker %s is not kept parked: %s", label, worker.id, refused)
                return False
            kept = True
        finally:
            if not kept:
                tier.settle(label)
        files = {path for path, _size in worker.mapped}
        cost = await asyncio.to_thread(parked_cost, worker.pid, files)
        if cost and tier.remeasured(label, worker, cost):
            self._parked_cost = cost
        log.info("model %s: worker %s parked in %.3f s: %.0f MiB beside its weights (PSS)",
                 label, worker.id, answer.seconds, cost / MIB)  # fmt: skip
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
