"""In-place swap: version A of a model replaced by version B under the memory budget, one worker
at a time, while both serve (docs/rollouts.md, In-place swap).

Peers unload before they load (a reload is downtime) or load B beside A (twice the memory).
Here each step starts one worker of B where the budget has room for it; where it has none,
one worker of A is drained first (it takes no new batch, finishes what it holds and stops) and
B's worker starts in the room it freed. Admission stays server/models/residency.py's, so the
budget check is the one the server makes for every start; the workers' memory never passes the
budget by more than the one worker that residency lets start while another one stops.

Meanwhile a request that names no version goes to whichever of A and B has a ready worker with
the least work queued per worker (:meth:`Swap.pick`, asked by server/rollouts/router.py), so
traffic follows the worker counts; a request naming A or B gets that one. A request that finds
no ready worker anywhere (one worker's room, between A's last worker and B's first) waits in
B's queue for B's first worker instead of loading one on demand (``ModelVersion.held``).

B failing to load (or finding no room) stops the swap and rolls it back by the same steps the
other way: B's workers drained, A's started again, the requests B held handed to A. At the end
B is the default version and A stays registered with no worker (its ``maxWorkers`` kept, so a
request naming it loads it on demand where the budget allows), or is unregistered when asked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from server.errors import MserveError, ServiceUnavailable
from server.metrics.server_metrics import Metrics
from server.models.residency import Residency
from server.models.version import ModelVersion

log = logging.getLogger(__name__)

RUNNING, DONE, ROLLED_BACK, FAILED = "running", "done", "rolled back", "failed"
MAX_STEPS_SHOWN = 40  # the last steps describe lists (a swap of 1024 workers takes 2048)


@dataclass
class Swap:
    """One swap of ``source`` by ``target``: its progress, what describe and the snapshot show."""

    source: ModelVersion
    target: ModelVersion
    workers: int  # B's workers at the end
    residency: Residency
    set_default: Callable[[str, str], None]
    changed: Callable[[], None]
    unregister: Callable[[], Awaitable[None]] | None = None  # A's, at the end (when asked)
    metrics: Metrics | None = None
    # A is the default version: requests naming none follow the workers, and B is the default
    # at the end; else the default and its traffic are left alone
    routes: bool = True
    # B's worker starts before A's is drained, the budget passed by that one worker meanwhile
    # (no dip in capacity); else A's is drained first and the budget is never passed
    overlap: bool = False
    state: str = RUNNING
    step: str = "starting"
    reason: str | None = None
    error: MserveError | None = None  # what stopped it (a rollback)
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    peak_bytes: int = 0
    steps: list[str] = field(default_factory=list)
    source_before: int = 0  # A's and B's worker counts when it began (the rollback's target)
    target_before: int = 0
    task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.source_before = len(self.source.slots)
        self.target_before = len(self.target.slots)

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def running(self) -> bool:
        return self.state == RUNNING

    # --- routing ----------------------------------------------------------------------------

    def pick(self) -> ModelVersion:
        """The version a request naming none goes to: the one with a ready worker and the least
        work per ready worker; none ready, the one starting a worker (B when both or neither
        are: B holds the request for its first worker)."""
        a, b = self.source, self.target
        ready_a, ready_b = a.ready_workers(), b.ready_workers()
        if ready_a and ready_b:
            return a if a.pending() * ready_b < b.pending() * ready_a else b
        if ready_a or ready_b:
            return a if ready_a else b
        return a if a.slots and not b.slots else b

    # --- the steps --------------------------------------------------------------------------

    async def run(self) -> None:
        """Move the workers from A to B; on a failure, back. Never raises (see ``reason``)."""
        a, b = self.source, self.target
        b.held = True
        self._say(
            f"swapping {a.label} ({len(a.slots)} worker(s)) for {b.label} ({self.workers}"
            f" worker(s)) under {self._budget()}"
        )
        self.changed()  # the snapshot keeps it from now on: a restart resumes it
        try:
            try:
                await self._move(a, b, self.workers, 0)
                if self.routes:
                    self.set_default(self.name, b.version)
                    self._say(f"{b.version} is now the default version of {self.name}")
                if self.unregister is not None:
                    await self._unregister_source()
                self._end(DONE, None)
            except MserveError as exc:
                self.reason, self.error = exc.message, exc
                self._say(f"failed: {exc.message}; rolling back to {a.label}", logging.ERROR)
                try:
                    await self._move(b, a, self.source_before, self.target_before)
                except MserveError as again:
                    self._end(FAILED, f"{exc.message}; the rollback failed too: {again.message}")
                else:
                    self._end(ROLLED_BACK, exc.message)
        except asyncio.CancelledError:  # the server stops: the snapshot resumes it at start
            b.held = False
            raise
        except Exception as exc:  # the supervisor's task guard: a bug of ours ends it, said
            log.exception("model %s: unexpected error swapping %s for %s", self.name, a.label,
                          b.label)  # fmt: skip
            self._end(FAILED, f"internal error: {exc!r}")
        await self._settle(a)
        await self._settle(b)
        self.changed()

    async def _move(
        self, frm: ModelVersion, to: ModelVersion, wanted: int, left: int
    ) -> None:  # fmt: skip
        """Bring ``to`` up to ``wanted`` workers and ``frm`` down to ``left``, one at a time:
        a worker of ``to`` starts where the budget has room, else after one of ``frm`` stopped.
        """
        while len(to.slots) < wanted:
            if len(frm.slots) > left and not await self.residency.fits(to):
                if self.overlap:
                    with self.residency.one_over(to):
                        await self._start(to, f" (the budget passed by it until {frm.label}'s"
                                              " next worker is drained)")  # fmt: skip
                    await self._drain(frm)
                    continue
                await self._drain(frm)
            await self._start(to)
        while len(frm.slots) > left:
            await self._drain(frm)

    async def _start(self, mv: ModelVersion, why: str = "") -> None:
        n = len(mv.slots) + 1
        self.step = f"starting worker {n} of {mv.label}"
        started = time.monotonic()
        await mv.scale(n, max(n, mv.settings.max_workers), synchronous=True)
        took = time.monotonic() - started
        self._say(f"started worker {n} of {mv.label} in {took:.2f} s{why}")
        await self._measure()
        self.changed()

    async def _drain(self, mv: ModelVersion) -> None:
        before = {s.worker_id for s in mv.slots}
        n = len(mv.slots) - 1
        self.step = f"draining a worker of {mv.label}"
        started = time.monotonic()
        # its ``maxWorkers`` stays: a request naming it after the swap loads it on demand
        await mv.scale(n, mv.settings.max_workers, synchronous=True)
        gone = ", ".join(sorted(before - {s.worker_id for s in mv.slots})) or "?"
        self._say(
            f"drained worker {gone} of {mv.label} in {time.monotonic() - started:.2f} s ({n} left)"
        )
        await self._measure()
        self.changed()

    async def _unregister_source(self) -> None:
        """``unregister=true``: A goes once B serves; a failure is said, and the swap is done."""
        assert self.unregister is not None
        try:
            await self.unregister()
        except MserveError as exc:
            self._say(f"could not unregister {self.source.label}: {exc.message}", logging.WARNING)
        else:
            self._say(f"unregistered {self.source.label}")

    async def _settle(self, mv: ModelVersion) -> None:
        """``minWorkers`` back to the workers it has (a failed start leaves it one over)."""
        if mv.settings.min_workers != len(mv.slots) and not mv.removing:
            await mv.scale(len(mv.slots), mv.settings.max_workers, synchronous=False)

    async def _measure(self) -> None:
        self.peak_bytes = max(self.peak_bytes, await self.residency.measure())

    def _end(self, state: str, reason: str | None) -> None:
        a, b = self.source, self.target
        b.held = False
        if not b.slots and len(b.queue):
            # the requests that waited for B's first worker: A answers them when it serves
            jobs = []
            while (job := b.queue.pop()) is not None:
                jobs.append(job)
            if a.slots:
                a.queue.requeue(jobs)
            else:
                error = ServiceUnavailable(f"swap of {self.name} to {b.version} failed: {reason}")
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(error)
        self.state, self.reason, self.ended_at = state, reason, time.time()
        self.step = state
        took = self.ended_at - self.started_at
        level = logging.INFO if state == DONE else logging.ERROR
        self._say(f"swap {state} in {took:.1f} s" + (f": {reason}" if reason else ""), level)
        if self.metrics is not None:
            self.metrics.model_swapped(self.name, state.replace(" ", "_"))

    def _say(self, line: str, level: int = logging.INFO) -> None:
        log.log(level, "model %s: %s", self.name, line)
        self.steps.append(f"{time.strftime('%H:%M:%S')} {line}")
        del self.steps[:-MAX_STEPS_SHOWN]

    def _budget(self) -> str:
        budget = self.residency.budget_bytes
        return "no memory budget" if budget is None else f"a budget of {budget >> 20} MiB"

    # --- what it shows ----------------------------------------------------------------------

    def shown(self) -> dict[str, Any]:
        """Describe's ``swap`` of both versions."""
        a, b = self.source, self.target
        return {
            "from": a.version,
            "to": b.version,
            "state": self.state,
            "step": self.step,
            "reason": self.reason,
            "workers": {a.version: len(a.slots), b.version: len(b.slots)},
            "targetWorkers": self.workers,
            "overlap": self.overlap,
            "startedAt": self.started_at,
            "endedAt": self.ended_at,
            "peakMemoryBytes": self.peak_bytes,
            "budgetBytes": self.residency.budget_bytes,
            "steps": list(self.steps),
        }

    def to_json(self) -> dict[str, Any]:
        """The snapshot's entry: a running swap is resumed at the next start."""
        return {
            "model": self.name,
            "from": self.source.version,
            "to": self.target.version,
            "workers": self.workers,
            "state": self.state,
            "reason": self.reason,
            "unregister": self.unregister is not None,
            "routes": self.routes,
            "overlap": self.overlap,
            "fromWorkers": self.source_before,
            "toWorkers": self.target_before,
        }


class Swaps:
    """Each model's swap, running or the last one ended (describe shows it until the next)."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics
        self._swaps: dict[str, Swap] = {}
        # the swaps that route requests naming no version, while they run: empty, a request
        # pays one test for them (server/rollouts/router.py)
        self.routing: dict[str, Swap] = {}
        # ended swaps read back from the snapshot, shown until a new one starts
        self.restored: dict[str, dict[str, Any]] = {}

    def get(self, name: str) -> Swap | None:
        return self._swaps.get(name)

    def running(self, name: str) -> Swap | None:
        swap = self._swaps.get(name)
        return swap if swap is not None and swap.running else None

    def pick(self, name: str) -> ModelVersion | None:
        """The version a request naming none gets while ``name`` swaps; None: no swap runs."""
        swap = self.routing.get(name)
        return swap.pick() if swap is not None and swap.running else None

    def start(self, swap: Swap) -> Swap:
        self._swaps[swap.name] = swap
        self.restored.pop(swap.name, None)
        swap.task = asyncio.create_task(swap.run(), name=f"swap {swap.name}")
        if swap.routes:
            self.routing[swap.name] = swap

            def ended(_task: asyncio.Task[None]) -> None:
                if self.routing.get(swap.name) is swap:
                    del self.routing[swap.name]

            swap.task.add_done_callback(ended)
        return swap

    def shown(self, name: str) -> dict[str, Any] | None:
        swap = self._swaps.get(name)
        if swap is not None:
            return swap.shown()
        saved = self.restored.get(name)
        if saved is None:
            return None
        keys = ("from", "to", "state", "reason")
        return {**{k: saved.get(k) for k in keys}, "targetWorkers": saved.get("workers"),
                "restored": True}  # fmt: skip

    def to_json(self) -> list[dict[str, Any]]:
        return [s.to_json() for s in self._swaps.values()] + [
            r for n, r in self.restored.items() if n not in self._swaps
        ]

    async def close(self) -> None:
        """The server stops: running swaps stop where they are (the snapshot resumes them)."""
        tasks = [s.task for s in self._swaps.values() if s.task is not None and not s.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
