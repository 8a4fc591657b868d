"""Continuous batching (TorchServe's ``continuousBatching: true``): the worker runs the steps.

The handler is called again and again. Each call (a step) gets the requests still generating
(sent again without their body: the handler keeps their state in ``context.cache``) plus new ones,
up to ``batchSize``. The worker runs the steps itself, back to back while anything generates
(mserve_worker/continuous.py): a step never waits for a round trip to the server. This pump keeps
the worker's requests at ``batchSize``: a queued request is sent the moment a slot frees (a
request finished, was cancelled or passed its deadline), and joins the worker's next step. After
each call the worker asks the handler's ``context.stopping_criteria`` which requests are done; a
request that goes on carries TorchServe's ``ts_stream_next: true`` response header in the step's
answer, and that answer becomes one chunk of its streamed response. A finished one ends its
stream (or, done in its first step, gets a plain answer) and frees its slot.

Under sequence batching a worker's ``batchSize`` counts sequences, not requests: the next request
of a sequence already in the worker (sent once the one before it streams) joins its next step
whatever the other sequences hold, as TorchServe's stateful example needs to cancel or end a
sequence while its stream runs.

With ``batchWait: fill`` (TorchServe's way) an idle worker's first step waits up to
``maxBatchDelay`` for ``batchSize`` requests, so that a burst starts together (its prompts
prefilled in one call); once it generates, newcomers join the next step at once, as TorchServe's
do. The default, ``busy``, sends an idle worker its first request at once.

A request whose client went away (its stream cancelled, or :meth:`Job.cancel`) or whose deadline
passed is dropped at once: the worker gets a CANCEL for it, leaves it out of its next step and
cleans up its state, and its slot goes to the next queued request in the same write.

A step that the worker does not answer within ``responseTimeout`` means a hung handler: the
worker is killed and replaced, and its requests get a 504.

The model's inference log (server/inference_log/) gets what the ordinary pump gives it: each
request answered whole (done in its first step, or refused there), each failed call, and each
streamed answer when its stream ends (its chunks joined).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from mserve_worker import protocol
from mserve_worker.protocol import Frame, Kind, ResponseItem
from server.errors import HandlerError, InternalError, WorkerDied, WorkerTimeout
from server.models.batching import Job
from server.models.pump import BatchPump, Retired, end_stream, fail_jobs
from server.streaming import ChunkStream
from server.workers.channel import Batch
from server.workers.process import Worker, WorkerState

log = logging.getLogger(__name__)

_CHUNK = Kind.CHUNK
NEXT_HEADER = "ts_stream_next"  # TorchServe's response header: "true" while a request goes on


def _no_pause() -> None:
    """A step's chunks need no back-pressure on the worker: one chunk per request per step."""


def _open_stream(
    pump: BatchPump, job: Job, status: int, content_type: str, headers: list[list[str]]
) -> ChunkStream:
    """The first chunk of ``job``'s answer: its stream, which its caller now gets (and the
    model's inference log, when it samples the request)."""
    stream = job.stream = ChunkStream(status, content_type, headers, _no_pause, _no_pause)
    stream.meter = job.meter  # its tenant's tokens and in-flight count (server/tenants/tokens.py)
    if pump.inference_log is not None:
        pump.inference_log.stream(job.item, job.enqueued_at, stream, job.tenant)
    job.future.set_result(stream)  # type: ignore[arg-type]
    return stream


class ContinuousPump(BatchPump):
    """One model's continuous-batching handler on one worker."""

    async def serve(self, worker: Worker, retire: asyncio.Event) -> str | None:
        """Feed the worker until retired (None) or the worker is lost (returns why)."""
        return await _Feed(self, worker, Retired(retire, self._others_serve, self.queue)).run()

    def _dropped(self, job: Job) -> bool:
        """Whether ``job`` leaves the worker now: its client went away (counted here when no
        frontend counted it) or it was cancelled."""
        if job.cancelled is not None:
            return True
        if job.gone():
            if job.cancel("client"):
                self.stats.cancelled("client")
            return True
        return False

    def _answer(self, job: Job, result: ResponseItem) -> bool:
        """One request's answer of a step: a chunk (it goes on: True), its end, or its error."""
        more = _take_next(result)
        if job.gone():
            return more
        stream = job.stream
        if result.status >= 400 and result.status != 499:
            if stream is None:
                job.future.set_result(result)
            else:
                text = bytes(result.body).decode("utf-8", "replace")
                stream.fail(HandlerError(f"handler of {self.label} failed mid-stream: {text}"))
            return False
        if not more:
            if stream is not None:
                end_stream(stream, result, self.label)
            elif not job.future.done():
                job.future.set_result(result)
            return False
        if stream is None:
            stream = _open_stream(self, job, result.status, result.content_type, result.headers)
        stream.push(bytes(result.body))
        return True


class _Feed:
    """The requests one worker generates, keyed by (joined batch id, place in it), and the
    callbacks that answer them, drop them and fill their slots."""

    def __init__(self, pump: ContinuousPump, worker: Worker, retired: Retired) -> None:
        self.pump = pump
        self.worker = worker
        self.retired = retired
        self.queue = pump.queue
        self.size = pump.settings.batch_size
        self.grouped = pump.settings.sequence_batching  # batchSize counts sequences: _admit
        self.want: int | None = None  # grouped: what the task waits for in the queue (_want)
        self.timeout_s = pump.settings.response_timeout_s
        self.fill = pump.settings.batch_wait == "fill"  # see _gather
        self.delay_s = pump.settings.max_batch_delay_ms / 1000
        self.members: dict[tuple[int, int], tuple[Job, Batch]] = {}
        self.lost: str | None = None  # why the worker is lost ("" until its end is known)
        self.wakeup: asyncio.Future[None] | None = None
        self.loop = asyncio.get_running_loop()
        self.progress_at = 0.0  # loop time of the last step (or of the first request sent)
        self.timer: asyncio.TimerHandle | None = None
        self.killing: asyncio.Future[None] | None = None

    async def run(self) -> str | None:
        worker = self.worker
        worker.on_lost(self._lost)
        worker.on_step(self._step)
        worker.on_withdraw(self._withdrawn)
        try:
            while self.lost is None:
                if self.fill and not self.members and len(self.queue):
                    await self._gather()
                self._admit(gathered=True)
                if not self.members and self.retired.is_set():
                    break
                if self.grouped and not self.retired.is_set():
                    self.want = self._want()
                    try:
                        await self.queue.wait(
                            want=self.want, load=lambda: len(self.members), take=self._take
                        )
                    finally:
                        self.want = None
                elif len(self.members) < self.size and not self.retired.is_set():
                    # a queued request is sent from take(), a callback: this task sleeps
                    await self.queue.wait(load=lambda: len(self.members), take=self._take)
                else:
                    self.wakeup = self.queue.new_future()
                    await self.wakeup
        finally:
            # a step still under way when the pump ends (its requests all left) is no breach
            worker.on_step(_ignore)
            worker.on_withdraw(None)
            worker.on_lost(None)
            if self.timer is not None:
                self.timer.cancel()
            jobs = [job for job, _ in self.members.values()]
            self.members.clear()
            if jobs:  # a lost worker took their state with it
                error = WorkerDied(f"worker {worker.id} of {self.pump.label} was lost")
                self.pump._retry_or_fail([j for j in jobs if not j.gone()], error)
            if worker.state is WorkerState.BUSY:
                worker.state = WorkerState.READY
        if self.lost is None:
            return None
        return self.lost or await worker.ended()

    async def _gather(self) -> None:
        """``batchWait: fill``: the first step of an idle worker waits up to ``maxBatchDelay``
        (from its first request) for ``batchSize`` requests, as TorchServe's continuous batching
        polls its queue while it has no request running."""
        deadline = self.loop.time() + self.delay_s
        while len(self.queue) < self.size and self.lost is None and not self.retired.is_set():
            left = deadline - self.loop.time()
            if left <= 0:
                return
            await self.queue.wait(left, self.size, lambda: len(self.members))

    # callbacks ----------------------------------------------------------------------------

    def _take(self) -> bool:
        """A job was queued: send it now if a slot is free (True: this task sleeps on)."""
        if self.lost is not None or self.retired.is_set():
            return False
        if len(self.members) >= self.size and not self.grouped:
            return False
        return self._admit() > 0

    def _admit(self, gathered: bool = False) -> int:
        """Send queued requests into the worker's free slots; how many. An idle worker's first
        step is the task's to gather under ``batchWait: fill`` (``gathered``: it did)."""
        if self.lost is not None or self.retired.is_set():
            return 0
        if self.fill and not self.members and not gathered:
            return 0
        jobs: list[Job] = []
        if self.grouped:
            self._take_grouped(jobs)
        else:
            while len(self.members) + len(jobs) < self.size:
                job = self.queue.pop()
                if job is None:
                    break
                jobs.append(job)
        if not jobs:
            return 0
        running = [job for job, _ in self.members.values()]
        _distinct_ids(running, jobs)
        try:
            batch = self.worker.join([job.item for job in jobs])
        except Exception as exc:  # the supervisor's task guard: never strand a caller
            log.exception("model %s: unexpected error sending requests", self.pump.label)
            fail_jobs(jobs, InternalError(f"internal error sending the requests: {exc!r}"))
            self._lose(f"unexpected error sending requests {exc!r}", kill=True)
            return 0
        if not self.members:
            self.progress_at = self.loop.time()
            self._arm()
        sent_at = time.monotonic()
        for i, job in enumerate(jobs):
            self.members[(batch.batch_id, i)] = (job, batch)
            job.sent = (self.worker, batch)
            if not job.sent_at:
                job.sent_at = sent_at
        return len(jobs)

    def _seats(self, jobs: list[Job]) -> set[object]:
        """The sequences (a request without one: itself) of the requests held and ``jobs``."""
        held = [job for job, _ in self.members.values()]
        return {job.group or id(job) for job in held + jobs}

    def _want(self) -> int:
        """How many queued requests wake the task (grouped): one while fewer than ``batchSize``
        sequences are held; else one more than are queued, since a newcomer may be the next
        request of a sequence held (``take`` sends it then; the others wait for a seat)."""
        if len(self._seats([])) < self.size:
            return 1
        return len(self.queue) + 1

    def _take_grouped(self, jobs: list[Job]) -> None:
        """Fill ``jobs`` from the lane: any request while fewer than ``batchSize`` sequences are
        held, then the next requests of sequences held."""
        seats = self._seats(jobs)
        while True:
            if len(seats) < self.size:
                job = self.queue.pop()
            else:
                job = self.queue.pop_matching(lambda j: j.group in seats)
            if job is None:
                return
            jobs.append(job)
            seats.add(job.group or id(job))

    def _step(self, frame: Frame) -> None:
        """A STEP frame: each request's chunk, end or error; the freed slots filled. Or a CHUNK
        frame the handler sent in the middle of a step."""
        if frame.kind is _CHUNK:
            self._chunks(frame)
            return
        try:
            members, results = protocol.parse_step(frame)
        except protocol.ProtocolError as exc:
            self.worker.chunks_broke_protocol(f"malformed STEP frame: {exc}")
            return
        try:
            self._settle(frame, members, results)
        except Exception as exc:  # the supervisor's guard: never strand a caller
            log.exception("model %s: unexpected error answering a step", self.pump.label)
            jobs = [self.members.pop(key)[0] for key in members if key in self.members]
            fail_jobs(jobs, InternalError(f"internal error answering the step: {exc!r}"))
        self.progress_at = self.loop.time()
        for key, (job, batch) in list(self.members.items()):
            # a client that left without a cancel reaching here (Job.cancel leaves at once)
            if self.pump._dropped(job) and key in self.members:
                self._leave(key, job, batch)
        self._refill()
        if not self.members:
            if self.worker.state is WorkerState.BUSY:
                self.worker.state = WorkerState.READY
            if self.retired.is_set():  # the task may sleep on the queue: it is done now
                self.queue.wake_all()
        self._wake()

    def _settle(
        self, frame: Frame, members: list[tuple[int, int]], results: list[ResponseItem] | None
    ) -> None:
        pump = self.pump
        jobs = []
        if results is None:  # the handler call failed as a whole: every request of it ends
            for key in members:
                entry = self.members.pop(key, None)
                if entry is not None:
                    jobs.append(entry[0])
            error = HandlerError(f"handler of {pump.label} failed: {frame.meta.get('error')}")
            fail_jobs(jobs, error)
            if pump.inference_log is not None and jobs:
                pump.inference_log.failed(
                    [j.item for j in jobs], [j.enqueued_at for j in jobs], error.status,
                    error.message, [j.tenant for j in jobs],
                )  # fmt: skip
            return
        started = time.perf_counter()
        whole = []  # answered in one piece (done in their first step, or refused)
        handled = None
        for key, result in zip(members, results, strict=True):
            entry = self.members.get(key)
            if entry is None:  # dropped meanwhile: the worker leaves it out of the next step
                continue
            job = entry[0]
            jobs.append(job)
            if job.trace is not None and job.handled is None:  # its span's handler: this step
                handled = handled or _handled(frame.meta, len(members))
                job.handled = handled
            if pump._answer(job, result):
                continue
            del self.members[key]
            if job.stream is None and not job.gone():
                whole.append((job, result))
        if pump.inference_log is not None and whole:
            pump.inference_log.settled(
                [j.item for j, _ in whole], [r for _, r in whole],
                [j.enqueued_at for j, _ in whole], frame.meta.get("inference_log"),
                [j.tenant for j, _ in whole],
            )  # fmt: skip
        handler_ms, entries = self.worker.frame_metrics(frame)
        pump.stats.batch_done(handler_ms, entries, jobs, time.perf_counter() - started)

    def _chunks(self, frame: Frame) -> None:
        try:
            members, chunks = protocol.parse_step_chunk(frame)
        except protocol.ProtocolError as exc:
            self.worker.chunks_broke_protocol(f"malformed CHUNK frame: {exc}")
            return
        for chunk in chunks:
            entry = self.members.get(members[chunk.index])
            if entry is None or entry[0].gone():
                continue
            job = entry[0]
            stream = job.stream
            if stream is None:
                stream = _open_stream(
                    self.pump, job, chunk.status or 200, chunk.content_type, chunk.headers
                )
            stream.push(bytes(chunk.body))

    def _withdrawn(self, batch: Batch, request_id: str) -> None:
        """:meth:`Job.cancel` of one of this worker's requests: it leaves now."""
        for key, (job, joined) in self.members.items():
            if joined is batch and job.item.request_id == request_id:
                self._leave(key, job, batch)
                self._refill()
                return

    def _refill(self) -> None:
        """Slots were freed: fill them; a worker left idle with requests queued gathers its
        next first step in the task (``batchWait: fill``), which may sleep on the queue."""
        self._admit()
        if self.fill and not self.members and len(self.queue):
            self.queue.wake_all()
        elif self.want is not None and self._want() != self.want:
            self.queue.wake_all()  # seats freed or requests taken: the task waits anew

    def _leave(self, key: tuple[int, int], job: Job, batch: Batch) -> None:
        del self.members[key]
        self.worker.leave(batch, [job.item.request_id])

    def _lost(self) -> None:
        self._lose("")

    def _lose(self, reason: str, kill: bool = False) -> None:
        if self.lost is None or (reason and not self.lost):
            self.lost = reason
        if kill:
            self.killing = asyncio.ensure_future(self.worker.kill())
        self._wake()
        self.queue.wake_all()

    def _wake(self) -> None:
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)

    # a worker that makes no step for responseTimeout -----------------------------------

    def _arm(self) -> None:
        if self.timer is None:
            self.timer = self.loop.call_at(self.progress_at + self.timeout_s, self._check)

    def _check(self) -> None:
        self.timer = None
        if not self.members or self.lost is not None:
            return
        if self.loop.time() < self.progress_at + self.timeout_s:
            self._arm()
            return
        jobs = [job for job, _ in self.members.values()]
        self.members.clear()
        message = (
            f"worker {self.worker.id} of {self.pump.label} made no step within"
            f" response_timeout_s={self.timeout_s:g}; it is being killed and replaced"
        )
        fail_jobs(jobs, WorkerTimeout(message))
        self.worker.timed_out = True
        self._lose(message, kill=True)


def _handled(meta: dict[str, Any], size: int) -> dict[str, Any]:
    """What a traced request's span says of the step that gave its first answer."""
    return {"handler_ms": meta.get("handler_ms"), "phases": meta.get("phases"), "batch_size": size}


def _ignore(frame: Frame) -> None:
    """A STEP or CHUNK that comes after the pump ended: nobody waits for its answers."""


def _distinct_ids(running: list[Job], new: list[Job]) -> None:
    """Give a newcomer whose request id a running request already has an id of its own
    (``<id>.2``, ...). Handlers key their per-request state (``context.cache``) by request id,
    and clients name their requests (``X-Request-ID``): a retry sent while the first try still
    generates would otherwise share, and corrupt, its state."""
    if not new:
        return
    taken = {job.item.request_id for job in running}
    for job in new:
        request_id = job.item.request_id
        if request_id in taken:
            n = 2
            while f"{request_id}.{n}" in taken:
                n += 1
            request_id = job.item.request_id = f"{request_id}.{n}"
        taken.add(request_id)


def _take_next(result: ResponseItem) -> bool:
    """Whether the worker said the request goes on; the header itself is not the client's."""
    headers = result.headers
    for i, (name, value) in enumerate(headers):
        if name.lower() == NEXT_HEADER:
            del headers[i]
            return value.lower() == "true"
    return False
