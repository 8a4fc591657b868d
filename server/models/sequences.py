"""Sequence batching (TorchServe's ``sequenceBatching: true``): stateful inference.

Requests that carry the same sequence id (TorchServe's ``ts_request_sequence_id`` header, its
name set by ``ts_header_key_sequence_id``) form a sequence. A sequence is bound to one worker
slot when it opens, so every request of it reaches the worker that holds its state, and its
requests go there one at a time, in the order they arrived: the next is released when the one
before it is answered (or, streamed, has sent its first chunk, as TorchServe's continuous
batching lets a sequence go on while its last answer streams).

A request without a sequence id opens a new sequence: the server names it ``ts-seq-<uuid>`` and
adds the id and TorchServe's start header (``ts_request_sequence_start: true``) to the request;
every answer of a sequence carries its id in the id header, so the client can go on with it.
A request with the end header, or whose answer carries it (the handler set it), closes its
sequence once answered; a request naming a closed sequence opens it again, on any worker
(TorchServe's way: the handler decides what a sequence it has no state for means). A sequence
expires when it has been idle ``sequenceMaxIdleMSec`` or open ``sequenceTimeoutMSec`` (0:
never): what of it still waits is answered 504, and a later request naming it is refused (503,
as TorchServe "does not process" it), so that a client cannot go on with state the server
dropped; the last :data:`EXPIRED_KEPT` expired ids are remembered.

At most ``maxNumSequence`` (at least batchSize x maxWorkers) sequences are open at once; a new
one beyond that waits for one to close: in order, or while the server has tenants in the fair
queue's order (server/models/fair.py FairLine: by weight, a quiet tenant's first). At most
``maxSequenceJobQueueSize`` requests of one sequence wait behind the one being run; another is
refused (429).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
import uuid
from collections.abc import Callable
from typing import Any

from server.config.model_settings import ModelSettings
from server.errors import (
    RequestExpired,
    SequenceExpired,
    SequenceOfAnotherTenant,
    TooManyRequests,
)
from server.models.batching import Job, JobQueue
from server.models.fair import FairLine

# Expired sequence ids remembered, to refuse their late requests: a bound on the memory (an id
# forgotten opens a new sequence again, as a closed one does)
EXPIRED_KEPT = 10_000


class Sequence:
    """One open (or waiting) sequence: its lane, the requests waiting, the one being run."""

    __slots__ = (
        "ending", "id", "lane", "opened_at", "owner", "pending", "running", "tag", "timer",
        "used_at",
    )  # fmt: skip

    def __init__(self, sequence_id: str, tag: float = 0.0, owner: str | None = None) -> None:
        self.id = sequence_id
        self.tag = tag  # its place in the line for a seat (FairLine), given when it opened
        self.owner = owner  # the tenant that opened it (None: no tenants); only it may go on
        self.lane: JobQueue | None = None  # its worker slot's queue; None while it waits
        self.pending: collections.deque[Job] = collections.deque()
        self.running: Job | None = None
        self.opened_at = self.used_at = time.monotonic()
        self.timer: asyncio.TimerHandle | None = None
        self.ending = False  # its last request is under way: it closes once answered


class Sequences:
    """The sequences of one model version. ``lanes``: the job queue of each live worker slot,
    with the number of sequences bound to it (the least loaded gets a new sequence)."""

    def __init__(
        self,
        label: str,
        settings: Callable[[], ModelSettings],
        headers: tuple[str, str, str],
        lanes: Callable[[], list[JobQueue]],
        cancelled: Callable[[str], None] | None = None,
    ) -> None:
        self.label = label
        self._settings = settings  # the model's current ones (scaling changes them)
        self.id_header, self.start_header, self.end_header = headers
        self._lanes = lanes
        self._cancelled = cancelled  # counts a request stopped by expiry (ModelStats.cancelled)
        self.open: dict[str, Sequence] = {}
        self.waiting: FairLine[Sequence] = FairLine()  # past maxNumSequence
        self.expired: collections.OrderedDict[str, str] = collections.OrderedDict()  # id: why

    @property
    def settings(self) -> ModelSettings:
        return self._settings()

    @property
    def limit(self) -> int:
        s = self.settings
        return max(s.max_num_sequence, s.batch_size * s.max_workers, 1)

    def admit(self, job: Job) -> None:
        """Route ``job`` to its sequence (opening one if need be): queued on the sequence's
        worker when it is next in line, else held. Raises TooManyRequests when the sequence
        already has ``maxSequenceJobQueueSize`` requests waiting, SequenceExpired when it
        names a sequence that expired."""
        item = job.item
        sequence_id = _header(item.headers, self.id_header)
        if not sequence_id:
            sequence_id = f"ts-seq-{uuid.uuid4()}"
            item.headers = [*item.headers, [self.id_header, sequence_id],
                            [self.start_header, "true"]]  # fmt: skip
        sequence = self.open.get(sequence_id)
        if sequence is None:
            why = self.expired.get(sequence_id)
            if why is not None:
                raise SequenceExpired(
                    f"sequence {sequence_id} of model {self.label} expired ({why}); send the"
                    f" request without {self.id_header} to start a new sequence"
                )
            tag = self.waiting.tag(job.tenant)  # its opener's tenant's turn
            owner = None if job.tenant is None else job.tenant.name
            sequence = self.open[sequence_id] = Sequence(sequence_id, tag, owner)
            self._bind(sequence)
        elif sequence.owner != (None if job.tenant is None else job.tenant.name):
            raise SequenceOfAnotherTenant(
                f"sequence {sequence_id} of model {self.label} was opened with another tenant's"
                f" key; send the request without {self.id_header} to start a sequence of your"
                " own, or with an id of your own"
            )
        waiting = sum(1 for j in sequence.pending if not j.future.done())
        if waiting >= self.settings.max_sequence_job_queue_size:
            raise TooManyRequests(
                f"sequence {sequence_id} of model {self.label} already has {waiting} request(s)"
                f" waiting (maxSequenceJobQueueSize={self.settings.max_sequence_job_queue_size})"
            )
        if _header(item.headers, self.end_header):
            sequence.ending = True
        job.group = sequence_id
        sequence.pending.append(job)
        sequence.used_at = time.monotonic()
        job.future.add_done_callback(functools.partial(self._answered, sequence, job))
        self._release(sequence)
        self._arm(sequence)

    def unbind(self, lane: JobQueue) -> None:
        """A worker slot is gone: its sequences go to another when their next request comes."""
        while lane.pop() is not None:  # what it held runs elsewhere
            pass
        for sequence in list(self.open.values()):
            if sequence.lane is lane:
                sequence.lane = None
                running = sequence.running
                if running is not None and not running.future.done():
                    sequence.pending.appendleft(running)
                sequence.running = None
                self._bind(sequence)
                self._release(sequence)

    def waiting_requests(self) -> int:
        """Requests accepted that no worker has yet: held by their sequence, or in a lane."""
        n = 0
        for sequence in self.open.values():
            for job in sequence.pending:
                n += not job.future.done()
            running = sequence.running
            if running is not None and running.sent is None and not running.future.done():
                n += 1
        return n

    def slot_added(self) -> None:
        """A worker slot started: sequences that waited for one open now."""
        if not self._lanes():
            return
        while self.waiting and len(self.bound()) < self.limit:
            nxt = self.waiting.pop()
            self._bind(nxt)
            if nxt.lane is None:
                return
            self._release(nxt)

    def close_all(self) -> None:
        for sequence in list(self.open.values()):
            self._close(sequence)

    # internals ------------------------------------------------------------------------------

    def _bind(self, sequence: Sequence) -> None:
        """Bind to the least loaded lane, unless maxNumSequence are bound: then it waits."""
        bound = self.bound()
        lanes = self._lanes()
        if not lanes or len(bound) >= self.limit:
            if sequence not in self.waiting:
                self.waiting.put(sequence, sequence.tag)
            return
        self.waiting.remove(sequence)
        self.waiting.seated(sequence.tag)
        load = {id(lane): 0 for lane in lanes}
        for s in bound:
            if id(s.lane) in load:
                load[id(s.lane)] += 1
        sequence.lane = min(lanes, key=lambda lane: load[id(lane)])

    def _release(self, sequence: Sequence) -> None:
        """Queue the sequence's next request on its worker, when none of it runs."""
        if sequence.lane is None or sequence.running is not None:
            return
        while sequence.pending:
            job = sequence.pending.popleft()
            if job.future.done():  # its client left while it waited
                continue
            sequence.running = job
            sequence.lane.put(job)
            return

    def _answered(self, sequence: Sequence, job: Job, future: asyncio.Future[Any]) -> None:
        """A request of the sequence has its answer (or its first chunk, or its error)."""
        if sequence.running is not job:
            return  # it left while it waited: nothing of it ran
        sequence.running = None
        sequence.used_at = time.monotonic()
        result = None if future.cancelled() or future.exception() else future.result()
        headers = getattr(result, "headers", None)  # an answer's, or a stream's head
        if headers is not None:
            if _header(headers, self.end_header) or _header(job.item.headers, self.end_header):
                sequence.ending = True
            if not _header(headers, self.id_header):
                headers.append([self.id_header, sequence.id])
        if sequence.ending and not sequence.pending:
            self._close(sequence)
            return
        self._release(sequence)
        self._arm(sequence)

    def _arm(self, sequence: Sequence) -> None:
        """(Re)start the sequence's expiry clock: idle and total, whichever comes first."""
        if sequence.timer is not None:
            sequence.timer.cancel()
            sequence.timer = None
        idle_ms, total_ms = self.settings.sequence_max_idle_ms, self.settings.sequence_timeout_ms
        ends = []
        if idle_ms:
            ends.append(sequence.used_at + idle_ms / 1000)
        if total_ms:
            ends.append(sequence.opened_at + total_ms / 1000)
        if ends:
            delay = max(0.0, min(ends) - time.monotonic())
            loop = asyncio.get_running_loop()
            sequence.timer = loop.call_later(delay, self._expire, sequence)

    def _expire(self, sequence: Sequence) -> None:
        sequence.timer = None
        if self.open.get(sequence.id) is not sequence:
            return
        now = time.monotonic()
        total_ms = self.settings.sequence_timeout_ms
        too_old = bool(total_ms) and now >= sequence.opened_at + total_ms / 1000
        busy = sequence.running is not None or any(not j.future.done() for j in sequence.pending)
        idle_ms = self.settings.sequence_max_idle_ms
        if not too_old and (busy or now < sequence.used_at + idle_ms / 1000):
            self._arm(sequence)  # a request came or runs: not idle after all
            return
        why = f"sequenceTimeoutMSec={total_ms}" if too_old else f"sequenceMaxIdleMSec={idle_ms}"
        error = RequestExpired(f"sequence {sequence.id} of model {self.label} expired ({why})")
        for job in sequence.pending:
            if job.cancel("deadline", error) and self._cancelled is not None:
                self._cancelled("deadline")
        self.expired[sequence.id] = why
        if len(self.expired) > EXPIRED_KEPT:
            self.expired.popitem(last=False)
        self._close(sequence)

    def _close(self, sequence: Sequence) -> None:
        if self.open.get(sequence.id) is sequence:
            del self.open[sequence.id]
        if sequence.timer is not None:
            sequence.timer.cancel()
            sequence.timer = None
        self.waiting.remove(sequence)
        sequence.lane = None
        self.slot_added()  # the next waiting one opens, if there is room now

    def bound(self) -> list[Sequence]:
        return [s for s in self.open.values() if s.lane is not None]


def _header(headers: list[list[str]], name: str) -> str | None:
    lowered = name.lower()
    for key, value in headers:
        if key.lower() == lowered:
            return value
    return None
