"""Per-model job queue and batch gathering.

The queue only *signals* waiting dispatchers; a woken dispatcher pops jobs itself. So a
dispatcher that is cancelled or retired while waiting can never take a job with it, and no job is
lost. A batch flushes at ``batch_size`` jobs or ``max_batch_delay_ms`` after its first job; by
default (``batchWait: busy``) also as soon as its worker has nothing to run, so a request never
waits for company while a worker idles.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from mserve_worker.protocol import RequestItem, ResponseItem
from server.errors import MserveError

if TYPE_CHECKING:
    from server.streaming import ChunkStream
    from server.tenants import Tenant
    from server.tenants.tokens import Usage
    from server.workers.channel import Batch
    from server.workers.process import Worker


class Trace(Protocol):
    """A request's server span while tracing is on (server/tracing/context.py's RequestTrace):
    what the queue sets on it and the frontends end it with."""

    popped: float  # monotonic: taken off the queue into a batch

    def finish(
        self, job: Job | None, status: int, error: str | None = None,
        stream: tuple[float, int] | None = None,
    ) -> None: ...  # fmt: skip


class Job:
    """One request on a model's queue (a plain class with slots: one is made per request)."""

    __slots__ = (
        "cancelled", "enqueued_at", "future", "group", "handled", "item", "meter", "retried",
        "sent", "sent_at", "stream", "tag", "tenant", "trace",
    )  # fmt: skip

    def __init__(self, item: RequestItem, future: asyncio.Future[ResponseItem]) -> None:
        self.item = item
        self.future = future
        self.enqueued_at = time.monotonic()
        self.retried = False  # sent to a worker that died, and given its one more try
        self.sent: tuple[Worker, Batch] | None = None  # (worker, batch) it was last sent in
        self.sent_at = 0.0  # monotonic time its batch was sent (TorchServe's queue latency ends)
        # its streamed response, once the worker sent a first chunk (the future holds it too)
        self.stream: ChunkStream | None = None
        self.trace: Trace | None = None  # its server span, while tracing is on
        # a traced request's handler call that gave its first answer ({handler_ms, phases,
        # batch_size}), where no RESULT of its batch says it: a continuous-batching step
        self.handled: dict[str, Any] | None = None
        self.cancelled: str | None = None  # why it was cancelled: see CANCEL_REASONS
        self.group: str | None = None  # its sequence id, under sequence batching
        self.tenant: Tenant | None = None  # who sent it (server/tenants/), while tenancy is on
        self.tag = 0.0  # its start tag in its tenant's lane (server/models/fair.py)
        # what it costs its tenant while it runs (server/tenants/tokens.py): its stream's meter
        self.meter: Usage | None = None

    def cancel(self, reason: str = "client", error: MserveError | None = None) -> bool:
        """Stop this request wherever it is; False if it was answered or cancelled already.

        The one hook for every frontend whose client goes away (``reason`` "client") and for
        the request deadline ("deadline", with the ``error`` its caller gets). Queued, it is
        skipped when popped; sent in a batch its worker has not started, the worker skips it;
        generating (continuous batching), the pump leaves it out of the next step and its
        stream ends (``error``) or is dropped. Counting it is the caller's (ModelStats)."""
        if self.cancelled is not None:
            return False
        future, stream = self.future, self.stream
        answered = stream is None or (stream.finished and not stream.cancelled)
        if future.done() and not future.cancelled() and answered:
            return False
        self.cancelled = reason
        if not future.done():
            if error is None:
                future.cancel()
            else:
                future.set_exception(error)
        elif stream is not None and not stream.finished:
            if error is None:
                stream.cancel()
            else:
                stream.fail(error)
        if self.sent is not None:
            worker, batch = self.sent
            worker.withdraw(batch, self.item.request_id)
        return True

    def gone(self) -> bool:
        """Whether nobody waits for this request's answer any more."""
        if self.cancelled is not None or self.future.cancelled():
            return True
        return self.stream is not None and self.stream.cancelled


# Why a request was cancelled, as mserve_requests_cancelled_total labels it: its client went
# away, or its deadline (clientTimeoutInMills) passed.
CANCEL_REASONS = ("client", "deadline")


class Flag(Protocol):
    """What stops a gatherer: an ``asyncio.Event``, or anything else that can say it is set."""

    def is_set(self) -> bool: ...


class QueueFull(Exception):
    pass


class JobQueue:
    fair = False  # serves tenants fairly (server/models/fair.py)

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._jobs: collections.deque[Job] = collections.deque()
        # (future, jobs it waits for, how busy its worker is, what takes a job at once): a
        # batch filling up sleeps until it can be completed
        self._waiters: collections.deque[_Waiter] = collections.deque()
        # the waiters that are filling a batch, with their worker's load: see wake_filling
        self._filling: dict[asyncio.Future[None], Callable[[], int]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def new_future(self) -> asyncio.Future[Any]:
        """A future on the queue's loop, found once: ``get_running_loop()`` costs a getpid()
        system call per call, which showed up once per request under strace."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop.create_future()

    def __len__(self) -> int:
        return len(self._jobs)

    def has_waiters(self) -> bool:
        """Whether a dispatcher waits for jobs (or was woken and has not run yet)."""
        return bool(self._waiters)

    def put(self, job: Job, waiting_elsewhere: int = 0) -> None:
        """Queue a job, unless ``maxsize`` jobs already wait: here, or sent to a worker that has
        not started them (``waiting_elsewhere``)."""
        if len(self._jobs) + waiting_elsewhere >= self.maxsize:
            # callers that went away leave their jobs here until popped; only at the bound is
            # it worth a pass to drop them, so they never turn a live request away
            self._jobs = collections.deque(j for j in self._jobs if not j.future.done())
            if len(self._jobs) + waiting_elsewhere >= self.maxsize:
                raise QueueFull
        self._jobs.append(job)
        self._wake(1)

    def requeue(self, jobs: list[Job]) -> None:
        """Put accepted jobs back at the head, in order; the bound does not apply to them."""
        self._jobs.extendleft(reversed(jobs))
        self._wake(len(jobs))

    def pop(self) -> Job | None:
        while self._jobs:
            job = self._jobs.popleft()
            if not job.future.done():  # the client went away: costs no worker time
                if job.trace is not None:
                    job.trace.popped = time.monotonic()  # its queue wait ends
                return job
        return None

    def pop_matching(self, wanted: Callable[[Job], bool]) -> Job | None:
        """The first waiting job that ``wanted`` accepts, taken from its place in the queue
        (a worker's lane: the next request of a sequence the worker runs)."""
        for job in self._jobs:
            if not job.future.done() and wanted(job):
                self._jobs.remove(job)
                if job.trace is not None:
                    job.trace.popped = time.monotonic()
                return job
        return None

    def _wake(self, n: int | None) -> None:
        """Wake up to ``n`` waiters whose wanted number of jobs is there (``None``: all), the
        least loaded first: a job goes to an idle worker rather than queue behind a busy one's
        running batch. Among equally loaded ones, the latest to wait goes first: it ran most
        recently, so its caches are warm (alternating idle workers cost 1.4x the CPU per MLP
        request)."""
        have = len(self._jobs)
        ready = [
            w for w in reversed(self._waiters) if not w[0].done() and (n is None or w[1] <= have)
        ]
        if n is not None and len(ready) > 1:
            ready.sort(key=_load_of)  # stable: the latest to wait first among equals
        for waiter, _want, _load, take in ready[:n]:
            if n is not None and take is not None and take():
                continue  # it sent the job from here: its task stays asleep
            waiter.set_result(None)

    def wake_all(self) -> None:
        """Make every waiting dispatcher re-check its own state (retire, shutdown)."""
        self._wake(None)

    async def wait(
        self,
        timeout_s: float | None = None,
        want: int = 1,
        load: Callable[[], int] | None = None,
        filling: bool = False,
        take: Callable[[], bool] | None = None,
    ) -> None:
        """Return when ``want`` jobs are queued, on ``wake_all``, or after ``timeout_s``.

        A batch of 8 that has 1 job waits for 7 more with one wake-up, not seven; a dispatcher
        wanting 1 job is woken first by a job that a filling batch could not complete. ``load``
        says how busy the waiter's worker is (batches in flight): the least busy is woken
        first. ``filling``: the waiter has a batch under way, which ``wake_filling`` sends.
        ``take`` (batches of one): called instead of waking the waiter when a job comes for
        it; True if it popped and sent a job itself, so the waiter waits on."""
        if len(self._jobs) >= want:
            return
        waiter: asyncio.Future[None] = self.new_future()
        entry = (waiter, want, load, take)
        self._waiters.append(entry)
        if filling and load is not None:
            self._filling[waiter] = load
        timer = None
        if timeout_s is not None:
            timer = self._loop.call_later(timeout_s, _settle, waiter)  # type: ignore[union-attr]
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            self._waiters.remove(entry)
            self._filling.pop(waiter, None)

    def wake_filling(self, load: Callable[[], int]) -> None:
        """Wake the batch filling for the worker that ``load`` measures (its worker went idle:
        what it has goes now)."""
        for waiter, waiter_load in self._filling.items():
            if waiter_load == load and not waiter.done():
                waiter.set_result(None)

    def fail_all(self, error: BaseException) -> int:
        failed = 0
        while self._jobs:
            job = self._jobs.popleft()
            if not job.future.done():
                job.future.set_exception(error)
                failed += 1
        return failed


async def gather_batch(
    queue: JobQueue,
    batch_size: int,
    max_delay_s: float,
    *stopping: Flag,
    load: Callable[[], int] | None = None,
    fill: bool = False,
    take: Callable[[], bool] | None = None,
) -> list[Job] | None:
    """Up to ``batch_size`` jobs, waiting at most ``max_delay_s`` after the first; None if one
    of ``stopping`` was set before a first job arrived (set it, then ``queue.wake_all()``).
    ``load``: see :meth:`JobQueue.wait`.

    Without ``fill`` the batch waits for more jobs only while its worker is busy (``load()``
    above 0; no ``load``: never): an idle worker gets what is queued at once, and under load
    batches still fill, since jobs pile up while the worker runs. Call ``queue.wake_filling``
    when the worker goes idle. With ``fill`` (TorchServe's way) it waits up to ``max_delay_s``
    for ``batch_size`` jobs whatever the worker does. ``take``: see :meth:`JobQueue.wait`
    (a job it takes never reaches this gatherer)."""
    while True:
        if any(event.is_set() for event in stopping):
            return None
        first = queue.pop()
        if first is not None:
            break
        if any(event.is_set() for event in stopping):  # pop() may have emptied the queue
            return None
        await queue.wait(load=load, take=take)
    jobs = [first]
    deadline = time.monotonic() + max_delay_s
    while len(jobs) < batch_size:
        job = queue.pop()
        if job is not None:
            jobs.append(job)
            continue
        if not fill and (load is None or load() == 0):
            break  # the worker is idle: waiting for company would only add latency
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        await queue.wait(remaining, batch_size - len(jobs), load, filling=not fill)
    return jobs


_Waiter = tuple[asyncio.Future[None], int, "Callable[[], int] | None", "Callable[[], bool] | None"]


def _load_of(entry: _Waiter) -> int:
    return 0 if entry[2] is None else entry[2]()


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
