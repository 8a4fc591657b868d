"""The warm tier: an evicted model's weights kept in the page cache, mapped by the server.

Between loaded (workers serve it) and cold (the next load reads and unpickles its weights from
disk) a model can be warm: its workers were stopped, but the checkpoints they mapped
(mserve_worker/sdk/weights.py reports them with READY) stay in the page cache, mapped by the
server itself. A new worker maps the same pages (``torch.load(mmap=True)``): no read, no unpickled
copy, no random initialisation, and it is forked from the environment's template with the
imports done. Better still, its last worker may be kept, parked (``park``): alive and idle,
its handler built and its weights mapped, woken by a message (mserve_worker/park.py).
docs/warm-tier.md has the walk-through and figures.

Page cache is not free, so the tier is bounded: ``warm_tier_budget_mb`` counts the pages the
server's mappings hold, as /proc/self/smaps tells them (what the kernel has not reclaimed),
and what each parked worker holds beside them (at most ``warm_tier_parked_workers``).
When a newly evicted model does not fit, the warm models worth least (their request rate times
what a cold load costs more than a wake) drop to cold: the mapping is closed and the file's
pages handed back to the kernel (``posix_fadvise(DONTNEED)``), counted in
``mserve_warm_tier_drops_total{reason}``.

Never stale: a wake maps the file at its path, whatever is there now, and the page cache is
the file's own, so a worker cannot read old weights from it. The tier only remembers each
file's identity (device, inode, size, modification time) to tell whether a wake is one: a
model whose files changed (a new archive registered under the same name, a file replaced)
is dropped as ``stale`` and loads cold, its parked worker (which maps the old file) stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

from server.models.file_map import FileMapping, held, map_file, total_pss
from server.workers.sandbox_users import WorkerUser, own_scratch

log = logging.getLogger(__name__)

MIB = 2**20
Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


class ParkedWorker(Protocol):
    """An evicted model's idle worker kept alive, its handler built and its weights mapped
    (server/workers/process.py's Worker, parked: mserve_worker/park.py)."""

    @property
    def pid(self) -> int | None: ...
    @property
    def mapped(self) -> list[tuple[str, int]]: ...
    async def stop(self, deadline_s: float) -> None: ...


@dataclass
class WarmFile:
    path: str
    identity: Identity | None  # when it was kept
    view: FileMapping | None = None  # None while being mapped


@dataclass
class WarmEntry:
    label: str
    files: list[WarmFile] = field(default_factory=list)
    bytes: int = 0  # its pages the server's mappings hold: the files' sizes until measured
    since: float = field(default_factory=time.monotonic)
    dropped: bool = False  # dropped to cold while its files were being mapped
    parked: ParkedWorker | None = None  # its last worker, parked (park)
    parked_bytes: int = 0  # what that worker holds beside the weights (its PSS less theirs)


@dataclass
class Taken:
    """What a waking model takes from the tier: the files its worker maps (none when it was
    not warm), and its parked worker, if one was kept."""

    files: list[str] = field(default_factory=list)
    worker: ParkedWorker | None = None
    # its last worker was still being parked when the model was asked for again: what that
    # park hands over (the worker, or None when it could not be parked)
    parking: asyncio.Future[ParkedWorker | None] | None = None


class WarmTier:
    """The warm models, ``{label: WarmEntry}``, within ``budget_bytes``.

    Its bookkeeping runs in the event loop; only mapping the files (which may read pages the
    kernel reclaimed) runs in a thread. A model is warm from the moment it is evicted: its
    pages are in the page cache then (its worker just used them), so a request arriving while
    they are being mapped wakes it warm, and the mapping is closed when it completes."""

    def __init__(
        self, budget_bytes: int | None, copies_root: Path | None = None, max_parked: int = 0
    ) -> None:
        """``copies_root``: where each model version's folder of mappable copies of legacy
        checkpoints goes (``<run_dir>/unpacked``, beside the unpacked archives);
        ``max_parked``: how many evicted models' workers may be kept parked (0: none)."""
        self.budget_bytes = budget_bytes or None  # 0 or None: no warm tier
        self.max_parked = max_parked if self.budget_bytes else 0
        self._stopping: set[asyncio.Task[None]] = set()  # parked workers being stopped
        # label: the end of its last worker's park, while it is under way (hold), and, once a
        # wake took the model meanwhile (take), what that wake waits for (park hands it over)
        self._parking: dict[str, asyncio.Future[ParkedWorker | None]] = {}
        self._handover: dict[str, asyncio.Future[ParkedWorker | None]] = {}
        self.copies_root = copies_root
        self._since = time.time()  # copies' folders given to workers since are in use
        self.entries: dict[str, WarmEntry] = {}
        self.drops: Counter[str] = Counter()  # reason: models dropped to cold
        self.on_drop: Callable[[str, str], None] | None = None  # (label, reason): metrics
        self._closing: set[asyncio.Task[None]] = set()  # mappings closing (_close_soon)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes is not None

    @property
    def bytes(self) -> int:
        """The pages the tier's mappings hold and its parked workers' PSS."""
        return sum(e.bytes + e.parked_bytes for e in self.entries.values())

    @property
    def parked(self) -> int:
        return sum(1 for e in self.entries.values() if e.parked is not None)

    def holds(self, label: str) -> bool:
        """Whether ``label`` is warm (its files unchanged since it was kept)."""
        entry = self.entries.get(label)
        return entry is not None and all(_identity(f.path) == f.identity for f in entry.files)

    def take(self, label: str) -> Taken:
        """A worker of ``label`` is about to start (or be woken): the files it wakes from
        (none when it was not warm) and its parked worker. The entry leaves the tier either
        way (the worker maps the pages now; the server's mapping is closed, the pages stay in
        the page cache). A stale one drops its pages and stops its parked worker."""
        entry = self.entries.get(label)
        if entry is None:
            return Taken()
        if not self.holds(label):
            self.drop(label, "stale")
            return Taken()
        del self.entries[label]
        self._close_soon(entry, evict=False)
        parking = self._parking.pop(label, None)
        if parking is not None:  # its worker is being parked: the park hands it over
            self._handover[label] = parking
        return Taken([f.path for f in entry.files], entry.parked, parking)

    def _close_soon(self, entry: WarmEntry, evict: bool) -> None:
        """Close ``entry``'s mappings (and, ``evict``, hand their pages back) in a thread:
        unmapping 512 MiB and dropping its pages from the page cache take tens of ms, more
        under memory pressure, which on the event loop every request would wait for (a
        Zipf run of 512 MiB models stalled the loop 6 s a minute). The views leave the
        entry now, so nothing uses them meanwhile."""
        closing = WarmEntry(entry.label, [], entry.bytes)
        for f in entry.files:
            closing.files.append(WarmFile(f.path, f.identity, f.view))
            f.view = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (the server's last steps): here and now
            _close(closing, evict)
            return
        task = loop.create_task(asyncio.to_thread(_close, closing, evict))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def park(
        self, label: str, worker: ParkedWorker, cost: int, worth: Callable[[str], float]
    ) -> str | None:
        """Keep ``label``'s last worker, parked (``cost``: what it holds beside its weights,
        as :func:`parked_cost` reads it, or an estimate until then), with its warm weights: the
        warm models worth less lose their parked worker, then their place, until it fits the
        budget and the count of ``max_parked``. None when kept; else why not (``label`` is
        not warm, or was woken or dropped meanwhile, or there is no room for it): the caller
        stops it."""
        if self.hand_over(label, worker):
            return None
        self._parking.pop(label, None)
        entry = self.entries.get(label)
        if entry is None or entry.parked is not None:
            return "its weights are not in the warm tier"
        budget = self.budget_bytes or 0
        mine = worth(label)
        while (full := self.parked >= self.max_parked) or self.bytes + cost > budget:
            others = [lb for lb in self.entries if lb != label]
            # others' parked workers of less worth go first (their weights stay warm), then,
            # over the budget, whole warm models of less worth
            pool = [lb for lb in others if self.entries[lb].parked is not None] or others
            victim = min(pool, key=lambda lb: (worth(lb), self.entries[lb].since), default=None)
            if victim is None or worth(victim) > mine:
                if full:
                    return f"warm_tier_parked_workers={self.max_parked} are parked"
                return (
                    f"what it holds ({cost / MIB:.0f} MiB) does not fit warm_tier_budget_mb="
                    f"{budget // MIB} beside what the tier holds ({self.bytes / MIB:.0f} MiB)"
                )
            if self.entries[victim].parked is not None:
                self.unpark(victim)
            else:
                self.drop(victim, "budget")
        entry.parked, entry.parked_bytes = worker, cost
        return None

    def remeasured(self, label: str, worker: ParkedWorker, cost: int) -> bool:
        """What ``label``'s parked ``worker`` holds beside its weights, read; False when it is
        no longer parked here (woken, stopped) meanwhile."""
        entry = self.entries.get(label)
        if entry is None or entry.parked is not worker:
            return False
        entry.parked_bytes = cost
        return True

    def hand_over(self, label: str, worker: ParkedWorker) -> bool:
        """``label``'s worker, just parked, goes to the wake that took the model while it was
        being parked (:meth:`take`), if one still waits for it."""
        waiting = self._handover.pop(label, None)
        if waiting is None or waiting.done():
            return False
        self._parking.pop(label, None)
        waiting.set_result(worker)
        return True

    def settle(self, label: str) -> None:
        """``label``'s last worker was not parked after all (not parkable, lost, refused): a
        wake waiting for it starts a new worker at once."""
        for pending in (self._parking.pop(label, None), self._handover.pop(label, None)):
            if pending is not None and not pending.done():
                pending.set_result(None)

    def unpark(self, label: str) -> None:
        """``label``'s parked worker stops (its weights stay warm): its code is about to
        change (a hot reload), or it makes room for another."""
        entry = self.entries.get(label)
        if entry is not None and entry.parked is not None:
            self._stop(entry)

    def _stop(self, entry: WarmEntry) -> None:
        worker, entry.parked, entry.parked_bytes = entry.parked, None, 0
        if worker is None:
            return
        log.info("model %s: its parked worker (pid %s) stops", entry.label, worker.pid)
        self.stop_later(worker)

    def stop_later(self, worker: ParkedWorker) -> None:
        """Stop ``worker`` in a task of its own (awaited when the server stops)."""
        task = asyncio.get_running_loop().create_task(worker.stop(5.0))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def stop_parked(self) -> None:
        """The server stops: every parked worker stops, awaited."""
        for entry in self.entries.values():
            self._stop(entry)
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)

    def drop(self, label: str, reason: str) -> None:
        """``label`` goes cold: its mapping closed, its pages handed back to the kernel."""
        entry = self.entries.pop(label, None)
        if entry is None:
            return
        entry.dropped = True
        self._stop(entry)
        self.settle(label)  # a worker still being parked is not kept
        self._close_soon(entry, evict=True)
        self.drops[reason] += 1
        log.info("model %s dropped from the warm tier to cold (%s; %.0f MiB)",
                 label, reason, entry.bytes / MIB)  # fmt: skip
        if self.on_drop is not None:
            self.on_drop(label, reason)

    def worker_init(
        self, name: str, version: str, policy: dict[str, Any] | None, user: WorkerUser | None
    ) -> dict[str, Any]:
        """INIT's fields for a worker of ``name:version`` while the tier is on: map checkpoints
        (``warm_tier``), and keep the mappable copies of legacy ones in the model version's
        own folder (``mapped_dir``; mserve_worker/sdk/convert.py), at most the budget each;
        the worker's sandbox ``policy`` may write there, and only there beside its archive.
        The worker converts, not the server: it loads the file as its handler would, under
        its sandbox, and the server never unpickles a model's weights."""
        init: dict[str, Any] = {"warm_tier": True}
        folder = self._copies(name, version)
        if folder is None:
            return init
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.utime(folder)  # in use (sweep_copies)
            if user is not None:  # the model's own uid writes there
                own_scratch(folder, user)
        except OSError as exc:
            log.warning("model %s:%s: no folder for mappable copies of legacy checkpoints"
                        " (%s): they load unmapped", name, version, exc)  # fmt: skip
            return init
        if policy is not None:
            policy.setdefault("write", []).append(str(folder))
        return {**init, "mapped_dir": str(folder), "mapped_max_bytes": self.budget_bytes}

    def _copies(self, name: str, version: str) -> Path | None:
        return None if self.copies_root is None else self.copies_root / f"{name}-{version}.mapped"

    async def remove_copies(self, name: str, version: str) -> None:
        """The model version was unregistered: its mappable copies go."""
        folder = self._copies(name, version)
        if folder is not None and folder.exists():
            await asyncio.to_thread(shutil.rmtree, folder, True)

    async def sweep_copies(self, registered: Iterable[tuple[str, str]]) -> None:
        """Remove the folders of mappable copies of model versions no longer registered
        (unregistered while the server was down, or not restored after a restart): their disk
        is bounded by the registered models' own legacy checkpoints."""
        if self.copies_root is None or not self.copies_root.is_dir():
            return
        keep = {self._copies(name, version) for name, version in registered}
        for folder in self.copies_root.glob("*.mapped"):
            # one a worker of this server's run was given is left alone: its model may be
            # registering right now
            if folder not in keep and folder.is_dir() and folder.stat().st_mtime < self._since:
                log.info("removing %s: mappable copies of a model no longer registered", folder)
                await asyncio.to_thread(shutil.rmtree, folder, True)

    def prune(self, registered: Iterable[str]) -> None:
        """Drop the models no longer registered."""
        keep = set(registered)
        for label in [lb for lb in self.entries if lb not in keep]:
            self.drop(label, "unregistered")

    def hold(
        self, label: str, files: list[tuple[str, int]], worth: Callable[[str], float],
        parking: bool = False,
    ) -> WarmEntry | None:  # fmt: skip
        """Take ``label``'s evicted ``files`` into the tier now (the warm models worth least
        (``worth``) dropped until they fit the budget with these), to be mapped by
        :meth:`map`; ``parking``: its last worker is about to be parked (:meth:`park`). None
        when not kept."""
        if not self.enabled or not files:
            return None
        budget = self.budget_bytes or 0
        declared = sum(size for _path, size in files)
        old = self.entries.pop(label, None)  # kept before and not woken since
        if old is not None:
            self._stop(old)
            self._close_soon(old, evict=False)
        if declared > budget:
            self.drops["too_big"] += 1
            if self.on_drop is not None:
                self.on_drop(label, "too_big")
            log.info(
                "model %s is not kept warm: its weights (%.0f MiB) exceed"
                " warm_tier_budget_mb=%d", label, declared / MIB, budget // MIB,
            )  # fmt: skip
            return None
        self._fit(declared, worth)  # the tier never maps past its budget
        entry = WarmEntry(label, [WarmFile(p, _identity(p)) for p, _s in files], declared)
        self.entries[label] = entry
        if parking and self.max_parked > 0:
            self.settle(label)
            self._parking[label] = asyncio.get_running_loop().create_future()
        return entry

    async def map(self, entry: WarmEntry) -> int:
        """Map ``entry``'s files (which reads in any page the kernel reclaimed meanwhile).
        Returns the bytes kept (0: not kept: it could not be mapped, or was woken or dropped
        meanwhile)."""
        label = entry.label
        try:
            views = await asyncio.to_thread(_map, [f.path for f in entry.files])
        except OSError as exc:
            log.warning("model %s is not kept warm: %s", label, exc)
            if self.entries.get(label) is entry:
                del self.entries[label]
                self._stop(entry)
                self.settle(label)
            return 0
        for f, view in zip(entry.files, views, strict=True):
            f.view = view
        if self.entries.get(label) is not entry:  # woken or dropped while being mapped
            self._close_soon(entry, evict=entry.dropped)
            return 0
        return entry.bytes

    def _fit(self, extra: int, worth: Callable[[str], float]) -> None:
        """Drop the warm models worth least until they and ``extra`` bytes fit the budget."""
        budget = self.budget_bytes or 0
        while self.entries and self.bytes + extra > budget:
            victim = min(self.entries, key=lambda lb: (worth(lb), self.entries[lb].since))
            self.drop(victim, "budget")

    async def measure(self) -> int:
        """Each warm model's pages the server's mappings hold now (/proc/self/smaps: what
        the kernel has not reclaimed). Returns the total."""
        if not self.entries:
            return 0
        # those mapped before the reading starts: one mapped meanwhile would read as 0 bytes
        # and let the tier pass its budget by it
        mapped = [e for e in self.entries.values() if all(f.view is not None for f in e.files)]
        # parked workers too: what each holds beside its weights moves as the processes that
        # share its template's pages come and go
        parked = [(e, e.parked) for e in self.entries.values() if e.parked is not None]
        try:
            paths = {f.path for e in mapped for f in e.files}
            resident = await asyncio.to_thread(held, "self", paths)
            costs = await asyncio.to_thread(
                lambda: [parked_cost(w.pid, {p for p, _s in w.mapped}) for _e, w in parked]
            )
        except (OSError, psutil.Error) as exc:
            log.warning("could not measure the warm tier: %s", exc)
            return self.bytes
        for entry in mapped:
            if self.entries.get(entry.label) is entry:
                entry.bytes = sum(resident[f.path].rss for f in entry.files if f.path in resident)
        for (entry, worker), cost in zip(parked, costs, strict=True):
            if entry.parked is worker and cost:
                entry.parked_bytes = cost
        return self.bytes


def _identity(path: str) -> Identity | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _map(paths: list[str]) -> list[FileMapping | None]:
    """Map each file read-only with its page tables filled (file_map.py: pages still in the
    page cache are mapped at once, reclaimed ones read back in; None: an empty file)."""
    views: list[FileMapping | None] = []
    try:
        for path in paths:
            views.append(map_file(path))
    except OSError:
        for view in views:
            if view is not None:
                view.close()
        raise
    return views


def _close(entry: WarmEntry, evict: bool) -> None:
    for f in entry.files:
        if f.view is not None:
            f.view.close()
            f.view = None
        if evict:  # pages no process maps any more go back to the kernel
            try:
                fd = os.open(f.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if _identity(f.path) == f.identity:  # never the pages of a newer file
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def parked_cost(pid: int | None, files: set[str]) -> int:
    """What a parked worker adds to the warm tier: its PSS less its share of the weights'
    file pages (the tier counts those once, as the server's own mapping holds them; pages the
    handler wrote to are its own and stay counted). 0 when it is gone."""
    if pid is None:
        return 0
    try:
        total = total_pss(pid)
        shared = sum(h.pss - h.anonymous for h in held(pid, files).values())
    except FileNotFoundError:  # gone
        return 0
    except OSError:  # no PSS to read (not Linux, or not allowed): all it holds
        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return 0
    return max(total - shared, 0)
