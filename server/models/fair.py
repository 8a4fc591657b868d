"""A model's queue served by weighted fair queuing between tenants (docs/tenants.md).

Start-time fair queuing: each tenant has a lane; a job's tag is its start time in virtual
time, ``max(now, its tenant's last finish)``, and its tenant's finish moves on by ``1/weight``.
The job taken is the lane head with the smallest tag, and virtual time becomes that tag. So
under contention tenants are served in proportion to their weights, a tenant that was quiet
starts at "now" (it is not owed a backlog, nor behind one), and a tenant alone takes every
job. A batch is filled by taking jobs one at a time, so batches are shared fairly too.

Used only while the server has tenants (server/tenants/); without, the plain JobQueue runs.
Under sequence batching each worker's lane is one too: it holds one request per sequence bound
to that worker, so a tenant with many sequences open is served in turn with one that has few
(the order within a sequence is kept: only one of its requests is ever in a lane), and the
sequences past ``maxNumSequence`` wait for a seat in a FairLine, the same order for them (in
use with or without tenants: without, it is arrival order).
The lanes stand in for JobQueue's deque behind ``len()``, so its waiting and waking run as
they are. Every request passes put and pop: they are written for a lone tenant's queue that
empties after each request (no lane made or looked up twice, no tuple or method call that
can be spared; see ``scripts/bench_tenants.py --micro``).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Generic, TypeVar

from server.models.batching import Job, JobQueue, QueueFull

if TYPE_CHECKING:
    from server.tenants import Tenant

T = TypeVar("T")

# Tenants contend while a second tenant's lane is waiting, and for this many requests taken
# after the tenant taken changed: then workers are sent fewer batches ahead (server/models/pump.py)
CONTENDED_FOR = 64


class _Lanes:
    """The tenants' lanes that hold jobs, oldest first; ``len()`` is all their jobs."""

    __slots__ = ("count", "lanes")

    def __init__(self) -> None:
        self.lanes: dict[str, collections.deque[Job]] = {}  # only lanes with jobs
        self.count = 0

    def __len__(self) -> int:
        return self.count


class FairJobQueue(JobQueue):
    fair = True

    def __init__(self, maxsize: int, served: dict[str, int] | None = None) -> None:
        super().__init__(maxsize)
        self._jobs: _Lanes = _Lanes()  # type: ignore[assignment]
        self._finish: dict[str, float] = {}  # each tenant's last finish tag
        self._virtual = 0.0
        # requests each tenant was served (taken to a worker): mserve_tenant_requests_served.
        # A sequence-batched model's worker lanes count into its queue's (``served``): a lane
        # goes with its worker, the counts must not
        self.served: dict[str, int] = {} if served is None else served
        # every tenant's lane, empty ones too: a queue that drains after each request would
        # otherwise make a deque per request
        self._made: dict[str, collections.deque[Job]] = {}
        self._taken = 0  # requests taken so far
        self._last: str | None = None  # the tenant of the last one
        self._contended_until = 0  # contended() until that many are taken
        # the pumps of the model's workers (server/models/pump.py): each may send a tenant's
        # job that starts to wait beside others' ahead of the batches its worker holds (True)
        self.ahead_takers: list[Callable[[], bool]] = []

    def __len__(self) -> int:
        return self._jobs.count

    def put(self, job: Job, waiting_elsewhere: int = 0) -> None:
        jobs = self._jobs
        if jobs.count + waiting_elsewhere >= self.maxsize:
            self._drop_gone()
            if jobs.count + waiting_elsewhere >= self.maxsize:
                raise QueueFull
        tenant = job.tenant
        if tenant is None:
            name, step = "", 1.0
        else:
            name, step = tenant.name, 1.0 / tenant.weight
        finish = self._finish
        start = finish.get(name, 0.0)
        if start < self._virtual:
            start = self._virtual
        finish[name] = start + step
        job.tag = start
        lane = self._made.get(name)
        if lane is None:
            lane = self._made[name] = collections.deque()
        newcomer = False
        if not lane:  # its lane starts waiting
            lanes = jobs.lanes
            lanes[name] = lane
            if len(lanes) > 1:  # beside another tenant's waiting jobs
                self._contended_until = self._taken + CONTENDED_FOR
                newcomer = True
            else:
                newcomer = self._taken < self._contended_until
        lane.append(job)
        jobs.count += 1
        if self._waiters:
            self._wake(1)
        elif newcomer:
            for take in self.ahead_takers:
                if take():
                    break

    def requeue(self, jobs: list[Job]) -> None:
        """Accepted jobs go back at the head of their lanes with the tags they had (taken
        again, they are counted served once)."""
        lanes = self._jobs.lanes
        for job in reversed(jobs):
            name = "" if job.tenant is None else job.tenant.name
            if self.served.get(name):
                self.served[name] -= 1
            lane = self._made.get(name)
            if lane is None:
                lane = self._made[name] = collections.deque()
            lanes[name] = lane
            lane.appendleft(job)
        self._jobs.count += len(jobs)
        self._wake(len(jobs))

    def contended(self) -> bool:
        """Whether several tenants are being served (see CONTENDED_FOR)."""
        return self._taken < self._contended_until

    def _took(self, name: str) -> None:
        taken = self._taken = self._taken + 1
        served = self.served
        served[name] = served.get(name, 0) + 1
        if name != self._last:
            if self._last is not None:
                self._contended_until = taken + CONTENDED_FOR
            self._last = name

    def pop(self) -> Job | None:
        jobs = self._jobs
        lanes = jobs.lanes
        while lanes:
            if len(lanes) == 1:  # one tenant waits: no tags to compare
                name, lane = lanes.popitem()
                job = lane.popleft()
                if lane:
                    lanes[name] = lane
            else:
                name, lane = min(lanes.items(), key=_head_tag)
                job = lane.popleft()
                if not lane:
                    del lanes[name]
            jobs.count -= 1
            if job.future.done():  # the client went away: costs no worker time
                continue
            self._virtual = job.tag
            self._took(name)
            if job.trace is not None:
                job.trace.popped = time.monotonic()
            return job
        return None

    def pop_matching(self, wanted: Callable[[Job], bool]) -> Job | None:
        best: tuple[str, Job] | None = None
        for name, lane in self._jobs.lanes.items():
            for job in lane:
                if not job.future.done() and wanted(job):
                    if best is None or job.tag < best[1].tag:
                        best = (name, job)
                    break
        if best is None:
            return None
        name, job = best
        lane = self._jobs.lanes[name]
        lane.remove(job)
        self._jobs.count -= 1
        if not lane:
            del self._jobs.lanes[name]
        self._took(name)
        if job.trace is not None:
            job.trace.popped = time.monotonic()
        return job

    def pop_ahead(self, busy: Container[str], most: int) -> list[Job]:
        """Up to ``most`` jobs of the tenants not in ``busy`` (those with requests in flight to
        the worker asking), smallest tag first, and none with a later tag than a ``busy``
        tenant's next: the batch a pump sends ahead of those its worker holds, which serves
        no one before their turn. Taking them moves "now" on as :meth:`pop` does."""
        jobs = self._jobs
        lanes = jobs.lanes
        out: list[Job] = []
        while len(out) < most:
            best: tuple[str, collections.deque[Job]] | None = None
            limit = float("inf")
            for name, lane in lanes.items():
                if name in busy:
                    limit = min(limit, lane[0].tag)
                elif best is None or lane[0].tag < best[1][0].tag:
                    best = (name, lane)
            if best is None or best[1][0].tag > limit:
                break
            name, lane = best
            job = lane.popleft()
            if not lane:
                del lanes[name]
            jobs.count -= 1
            if job.future.done():  # the client went away
                continue
            if job.tag > self._virtual:
                self._virtual = job.tag
            self._took(name)
            if job.trace is not None:
                job.trace.popped = time.monotonic()
            out.append(job)
        return out

    def fail_all(self, error: BaseException) -> int:
        failed = 0
        lanes, self._jobs.lanes, self._jobs.count = self._jobs.lanes, {}, 0
        for lane in lanes.values():
            jobs = list(lane)
            lane.clear()
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(error)
                    failed += 1
        return failed

    def _drop_gone(self) -> None:
        """Callers that went away leave their jobs until popped; at the bound they go."""
        jobs = self._jobs
        for name in list(jobs.lanes):
            lane = jobs.lanes[name]
            kept = [j for j in lane if not j.future.done()]
            lane.clear()
            lane.extend(kept)
            if not lane:
                del jobs.lanes[name]
        jobs.count = sum(len(lane) for lane in jobs.lanes.values())


def _head_tag(entry: tuple[str, collections.deque[Job]]) -> float:
    return entry[1][0].tag


class FairLine(Generic[T]):
    """What waits for a seat, let in by the fair queue's order: sequences past
    ``maxNumSequence`` (server/models/sequences.py). Each gets a start tag when it comes, as a
    job does in FairJobQueue (``max(now, its tenant's last finish)``, the finish moving on by
    ``1/weight``), whether it waits or is seated at once; a seat freed goes to the smallest tag
    waiting, ties to the one that came first. Without tenants (tenant None) tags rise by one
    each: arrival order. Taking the smallest of all is a pass over what waits, once per seat
    freed: the line is bounded by the model's queue (each waiting sequence holds a request)."""

    __slots__ = ("_finish", "_tags", "_virtual")

    def __init__(self) -> None:
        self._tags: dict[T, float] = {}  # what waits, in arrival order: its tag
        self._finish: dict[str, float] = {}  # each tenant's last finish tag
        self._virtual = 0.0  # the tag of the last one seated

    def __len__(self) -> int:
        return len(self._tags)

    def __contains__(self, item: T) -> bool:
        return item in self._tags

    def tag(self, tenant: Tenant | None) -> float:
        """The start tag of ``tenant``'s next newcomer."""
        name, step = ("", 1.0) if tenant is None else (tenant.name, 1.0 / tenant.weight)
        start = max(self._finish.get(name, 0.0), self._virtual)
        self._finish[name] = start + step
        return start

    def put(self, item: T, tag: float) -> None:
        self._tags[item] = tag

    def remove(self, item: T) -> None:
        self._tags.pop(item, None)

    def pop(self) -> T:
        """The next to be seated (its seat's :meth:`seated` moves "now" on); the line must
        not be empty (ValueError)."""
        tags = self._tags
        item = min(tags, key=tags.__getitem__)
        del tags[item]
        return item

    def seated(self, tag: float) -> None:
        """One with ``tag`` took a seat: "now" is its tag (it never moves back)."""
        if tag > self._virtual:
            self._virtual = tag
