"""The batch pump: feeds one worker from its model's job queue.

It forms batches (server/models/batching.py), keeps up to ``pipeline_depth`` of them in the
worker's socket, answers each batch's callers when it settles (streamed answers chunk by chunk),
and on a lost worker fails, requeues or retries (``retryOnWorkerDeath``) what it held, so no
caller waits on a dead worker. Starting, restarting and retiring workers is the slot
supervisor's job (server/models/version.py); the pump runs while one worker lives.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mserve_worker import protocol
from mserve_worker.protocol import STREAM_FAILED_HEADER, TOO_LARGE_HEADER, Frame
from server.config.model_settings import ModelSettings
from server.errors import (
    HandlerError,
    InternalError,
    MserveError,
    WorkerDied,
    WorkerTimeout,
)
from server.metrics.model_stats import ModelStats
from server.models.batching import Job, JobQueue, gather_batch
from server.models.fair import FairJobQueue
from server.streaming import ChunkStream
from server.workers.channel import Batch, ChannelClosed
from server.workers.process import Worker

if TYPE_CHECKING:
    from server.inference_log import InferenceLogger

log = logging.getLogger(__name__)

# Requests one worker holds at once: the batch it runs plus those already in its socket.
IN_FLIGHT_REQUESTS = 8


class Retired:
    """A retiring worker's stop signal, as its gatherer sees it: a worker retired while other
    workers remain stops at once; the model's last workers (scaled to 0) first run what is
    still queued, so scaling down never drops an accepted request."""

    def __init__(
        self, retire: asyncio.Event, others_serve: Callable[[], bool], queue: JobQueue
    ) -> None:
        self._retire = retire
        self._others_serve = others_serve
        self._queue = queue

    def is_set(self) -> bool:
        if not self._retire.is_set():
            return False
        return self._others_serve() or len(self._queue) == 0


class _Pipeline:
    """Batches in flight to one worker, and why it was lost (if it was)."""

    def __init__(
        self,
        depth: int,
        new_future: Callable[[], asyncio.Future[None]],
        on_idle: Callable[[Callable[[], int]], None] | None = None,
    ) -> None:
        self.depth = depth
        self._on_idle = on_idle  # called with ``load`` when the last batch in flight settles
        # called when a batch settles: sends the next one from there if it can (True), so the
        # gatherer task need not wake (see BatchPump.serve)
        self.refill: Callable[[], bool] | None = None
        self.in_flight = 0
        self.lost = asyncio.Event()
        self.reasons: list[str] = []
        self.tasks: set[asyncio.Task[None]] = set()  # settling failed batches
        self._new_future = new_future
        self._waiter: asyncio.Future[None] | None = None

    def load(self) -> int:
        return self.in_flight

    async def wait(self) -> None:
        """Until a batch is settled or the worker is lost."""
        self._waiter = self._new_future()
        await self._waiter

    def done(self, refill: bool = True) -> None:
        """A batch settled. ``refill``: it was answered, so the worker can take the next one
        (a failed batch's worker may be on its way out: the gatherer decides)."""
        self.in_flight -= 1
        if not refill or self.refill is None or not self.refill():
            self._wake()
        if self.in_flight == 0 and self._on_idle is not None:
            self._on_idle(self.load)

    def lose(self, reason: str) -> None:
        self.reasons.append(reason)
        self.lost.set()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class BatchPump:
    """Batches from one model's queue to one of its workers, and their answers back.

    ``others_serve``: whether the model has workers besides the retiring one (see Retired)."""

    def __init__(
        self,
        label: str,
        queue: JobQueue,
        settings: ModelSettings,
        stats: ModelStats,
        others_serve: Callable[[], bool],
        inference_log: InferenceLogger | None = None,
    ) -> None:
        self.label = label
        self.inference_log = inference_log
        self.queue = queue
        self.settings = settings
        self.stats = stats
        self._others_serve = others_serve

    async def serve(self, worker: Worker, retire: asyncio.Event) -> str | None:
        """Serve batches until retired (None) or the worker is lost (returns why).

        One gatherer forms batches in turn (a batch is complete, its delay over or, unless the
        model's ``batch_wait`` is "fill", its worker idle, before the next one starts to form)
        and keeps up to ``pipeline_depth`` of them in the worker, so the next is already in its
        socket when it finishes one. An answered batch is settled from its future's callback,
        waking no task; only a batch that failed takes one."""
        fill = self.settings.batch_wait == "fill"
        depth = pipeline_depth(self.settings.batch_size)
        if worker.concurrent:  # TorchServe's async worker is sent every batch the queue holds
            depth = max(depth, -(-self.settings.job_queue_size // self.settings.batch_size))
        on_idle = None if fill or self.settings.batch_size == 1 else self.queue.wake_filling
        # tenants: a fair queue, and the pipeline that sends batches ahead
        fair_queue = self.queue if isinstance(self.queue, FairJobQueue) else None
        fair_pipe = None
        if fair_queue is not None and not worker.concurrent:
            pipe: _Pipeline = _FairPipeline(depth, self.queue.new_future, on_idle, fair_queue)
            fair_pipe = pipe
        else:
            pipe = _Pipeline(depth, self.queue.new_future, on_idle)
        delay_s = self.settings.max_batch_delay_ms / 1000
        retired = Retired(retire, self._others_serve, self.queue)

        def lost_while_idle() -> None:  # a death with batches in flight is seen through them
            if pipe.in_flight == 0 and not pipe.lost.is_set():
                pipe.lose("")
                self.queue.wake_all()

        worker.on_lost(lost_while_idle)
        worker.on_chunk(functools.partial(self._chunk, worker))
        queue, timeout_s = self.queue, self.settings.response_timeout_s
        send_failed = f"unexpected error sending a batch to worker {worker.id}"
        size = self.settings.batch_size
        one = size == 1

        def send(live: list[Job], ahead: bool = False) -> bool:
            """Send one batch; False if that failed (its callers got a 500; the caller then
            kills the worker)."""
            try:
                sent_at = time.monotonic()
                batch = worker.send_batch([j.item for j in live], timeout_s, ahead)
            except Exception as exc:  # the supervisor's task guard: never strand a caller
                log.exception("model %s: unexpected error sending a batch", self.label)
                fail_jobs(live, InternalError(f"internal error sending the batch: {exc!r}"))
                return False
            pipe.in_flight += 1
            self.stats.send_s = time.monotonic() - sent_at
            batch.jobs = live
            for job in live:
                job.sent = (worker, batch)
                job.sent_at = sent_at
            batch.future.add_done_callback(
                functools.partial(self._settle, pipe, worker, live, batch)
            )
            if fair_pipe is not None:
                fair_pipe.sent(batch, ahead)
            return True

        def lose_worker() -> None:
            """A send from a callback failed: kill the worker (from a task) and stop."""
            kill = asyncio.ensure_future(worker.kill())
            pipe.tasks.add(kill)
            kill.add_done_callback(pipe.tasks.discard)
            pipe.lose(send_failed)

        def take() -> bool:
            """Send what is queued from here, a callback, rather than wake this task to do it (a
            task step, futures and coroutines per request), when nothing would keep this task
            from sending it at once: at batch size 1 the next request; at a larger one (not
            ``fill``) what is queued, up to ``batch_size``, when the worker is idle, which is
            what the gatherer would send (so a lone request costs what it does at batch size
            1). True if it took any."""
            if (
                pipe.in_flight >= pipe.depth
                or (pipe.in_flight and not one)
                or pipe.lost.is_set()
                or retired.is_set()
                or not worker.can_take()
            ):
                return False
            job = queue.pop()
            if job is None:
                return False
            live = [job]
            while len(live) < size and (job := queue.pop()) is not None:
                live.append(job)
            if not send(live):
                lose_worker()
            return True

        def ahead() -> bool:
            """A tenant's job started to wait beside others' (FairJobQueue.put), or a batch
            settled while tenants contend: if this worker holds a batch it has not started, and
            a waiting job's tenant has nothing in flight here but batches sent ahead, send that
            tenant's jobs (and those of any other such tenant, up to ``batch_size``; only those
            the fair order serves no later than the others' waiting ones) now, to run before
            it; the next such batch once this one started. True if it sent one."""
            assert fair_pipe is not None and fair_queue is not None
            if (
                fair_pipe.ahead_waits()
                or pipe.lost.is_set()
                or retired.is_set()
                or not worker.can_take()
            ):
                return False
            busy = fair_pipe.busy()
            if not busy:  # the worker runs no other tenant's batch: the gatherer sends
                return False
            live = fair_queue.pop_ahead(busy, size)
            if not live:
                return False
            if not send(live, ahead=True):
                lose_worker()
            return True

        def refill() -> bool:
            """A batch settled: take the next request, unless a gatherer waits for work (an
            idle worker's gets it first: queue.put picks the least loaded)."""
            return not queue.has_waiters() and take()

        if one:
            pipe.refill = refill
        sends_ahead = fair_pipe is not None and fair_queue is not None and worker.reorders
        if sends_ahead:
            fair_queue.ahead_takers.append(ahead)
            fair_pipe.send_ahead = ahead
        try:
            await self._gather(worker, pipe, retired, send, take, fill, delay_s, send_failed)
        finally:
            if sends_ahead:
                fair_queue.ahead_takers.remove(ahead)
                fair_pipe.send_ahead = None
        pipe.refill = None
        while pipe.in_flight:  # a retiring worker finishes what it was given
            await pipe.wait()
        worker.on_lost(None)
        if not pipe.reasons:
            return None
        # "" is a batch that was only queued behind the lost one, or a death while idle: say
        # the real why
        return next((r for r in pipe.reasons if r), None) or await worker.ended()

    async def _gather(
        self, worker: Worker, pipe: _Pipeline, retired: Retired,
        send: Callable[[list[Job]], bool], take: Callable[[], bool], fill: bool,
        delay_s: float, send_failed: str,
    ) -> None:  # fmt: skip
        """Form batches and send them while the worker lives and is not retired."""
        queue, one = self.queue, self.settings.batch_size == 1
        while not pipe.lost.is_set():
            if pipe.in_flight >= pipe.depth:
                await pipe.wait()
                continue
            await worker.drain()
            jobs = await gather_batch(
                queue, self.settings.batch_size, delay_s, retired, pipe.lost,
                load=pipe.load, fill=fill, take=take if one or not fill else None,
            )  # fmt: skip
            if jobs is None:
                break
            live = [j for j in jobs if not j.future.done()]
            if not live:
                continue
            if worker.held:  # it began a hot reload's prepare meanwhile: another worker runs them
                queue.requeue(live)
                continue
            if not send(live):
                await worker.kill()
                pipe.lose(send_failed)
                break

    def _settle(
        self, pipe: _Pipeline, worker: Worker, live: list[Job], batch: Batch, _done: Any
    ) -> None:
        """A batch's future is done: answer its callers, or hand a failure to a task."""
        try:
            started = time.perf_counter()
            results = worker.answered(batch, len(live))
            if results is None:
                task = asyncio.ensure_future(self._settle_failed(pipe, worker, live, batch))
                pipe.tasks.add(task)
                task.add_done_callback(pipe.tasks.discard)
                return
            for job, result in zip(live, results, strict=True):
                if not job.future.done():
                    job.future.set_result(result)
                elif job.stream is not None:
                    end_stream(job.stream, result, self.label)
            if self.inference_log is not None:
                self._log_settled(live, results, batch)
            handler_ms, entries = worker.result_metrics(batch)
            self.stats.batch_done(handler_ms, entries, live, time.perf_counter() - started)
            # answered: nothing reads its jobs any more (CHUNKs came before the RESULT), and
            # job.sent -> batch -> jobs -> job was a cycle per batch, ~20 objects a request left
            # for the garbage collector to find (~4% of the frontend's instructions, callgrind)
            batch.jobs = None
        except Exception as exc:  # the supervisor's guard: never strand a caller
            log.exception("model %s: unexpected error settling a batch", self.label)
            fail_jobs(live, InternalError(f"internal error answering the batch: {exc!r}"))
        pipe.done()

    async def _settle_failed(
        self, pipe: _Pipeline, worker: Worker, live: list[Job], batch: Batch
    ) -> None:
        try:
            reason = await self._run(worker, live, batch)
        finally:
            pipe.done(refill=False)
        if reason is not None:  # "" included
            pipe.lose(reason)
            self.queue.wake_all()  # the gatherer waiting for jobs must see it too

    async def _run(self, worker: Worker, live: list[Job], batch: Batch) -> str | None:
        """Answer a sent batch's jobs; why the worker is lost, if it is."""
        try:
            results = await worker.batch_result(batch, [j.item for j in live])
        except HandlerError as exc:
            fail_jobs(live, exc)
            if self.inference_log is not None:
                self.inference_log.failed(
                    [j.item for j in live], [j.enqueued_at for j in live], exc.status, exc.message,
                    [j.tenant for j in live],
                )  # fmt: skip
            return None
        except ChannelClosed:  # queued behind a batch that lost the worker: it never ran
            self.queue.requeue(live)
            return ""
        except WorkerDied as exc:
            self._retry_or_fail(live, exc)
            return exc.message
        except WorkerTimeout as exc:  # never retried: the request may be what hangs
            fail_jobs(live, exc)
            return exc.message
        except Exception as exc:  # the supervisor's task guard: never strand a caller
            log.exception("model %s: unexpected error running a batch", self.label)
            fail_jobs(live, InternalError(f"internal error running the batch: {exc!r}"))
            await worker.kill()
            return f"unexpected error {exc!r}"
        for job, result in zip(live, results, strict=False):
            if not job.future.done():
                job.future.set_result(result)
            elif job.stream is not None:
                end_stream(job.stream, result, self.label)
        if self.inference_log is not None:
            plain = [(j, r) for j, r in zip(live, results, strict=False) if j.stream is None]
            self.inference_log.settled(
                [j.item for j, _ in plain], [r for _, r in plain],
                [j.enqueued_at for j, _ in plain], tenants=[j.tenant for j, _ in plain],
            )  # fmt: skip
        return None

    def _log_settled(self, live: list[Job], results: list[Any], batch: Batch) -> None:
        """Hand an answered batch to the model's inference log (a streamed answer is logged
        when its stream ends, from the ChunkStream)."""
        assert self.inference_log is not None
        reply = batch.future.result()
        jobs = [(j, r) for j, r in zip(live, results, strict=True) if j.stream is None]
        self.inference_log.settled(
            [j.item for j, _ in jobs], [r for _, r in jobs], [j.enqueued_at for j, _ in jobs],
            reply.meta.get("inference_log"), [j.tenant for j, _ in jobs],
        )  # fmt: skip

    def _chunk(self, worker: Worker, batch: Batch, frame: Frame) -> None:
        """A CHUNK frame of the batch ``worker`` runs: each chunk goes to its job's stream, the
        first one of a job opening it (its future then resolves to the stream)."""
        jobs = batch.jobs
        try:
            batch_id, chunks = protocol.parse_chunk(frame)
        except protocol.ProtocolError as exc:
            worker.chunks_broke_protocol(f"malformed CHUNK frame: {exc}")
            return
        if jobs is None or batch_id != batch.batch_id:
            worker.chunks_broke_protocol(
                f"CHUNK for batch {batch_id} while it runs batch {batch.batch_id}"
            )
            return
        for chunk in chunks:
            if chunk.index >= len(jobs):
                worker.chunks_broke_protocol(
                    f"CHUNK for request {chunk.index} of batch {batch_id}, which has {len(jobs)}"
                )
                return
            job = jobs[chunk.index]
            stream = job.stream
            if stream is None:
                stream = job.stream = ChunkStream(
                    chunk.status or 200, chunk.content_type, chunk.headers,
                    worker.pause_reading, worker.resume_reading,
                    functools.partial(worker.stop_streaming, batch, job.item.request_id),
                )  # fmt: skip
                stream.meter = job.meter  # its tenant's tokens and in-flight count
                if self.inference_log is not None:
                    self.inference_log.stream(job.item, job.enqueued_at, stream, job.tenant)
                if job.future.done():  # its caller left before the first chunk: stop it
                    stream.cancel()
                else:
                    # read no more of the worker until a frontend takes the stream (next loop
                    # iteration): a handler flooding chunks would otherwise fill the backlog
                    # first and delay the first chunk by milliseconds
                    stream.pause()
                    job.future.set_result(stream)  # type: ignore[arg-type]
            stream.push(bytes(chunk.body))

    def _retry_or_fail(self, jobs: list[Job], error: WorkerDied) -> None:
        """A dead worker's jobs: back to the head of the queue once when the model allows it
        (the next free worker, another one or the replacement, runs them), else failed."""
        retry = []
        if self.settings.retry_on_worker_death:
            retry = [j for j in jobs if not j.retried and not j.future.done()]
        for job in retry:
            job.retried = True
        if retry:
            log.warning(
                "model %s: retrying %d request(s) of a dead worker once", self.label, len(retry)
            )
            self.queue.requeue(retry)
        fail_jobs([j for j in jobs if j not in retry], error)


class _FairPipeline(_Pipeline):
    """While tenants contend for the queue (server/models/fair.py), a worker is sent at most 2
    batches ahead: what waits in its socket is served in order, not fairly. Otherwise (one
    tenant) as many as without tenants: fewer cost the frontend more writes per request.

    A tenant whose job starts to wait while the worker holds a batch it has not started, and
    who has nothing in flight to it (but batches sent ahead), is sent a batch of its own that
    runs next, before the held one (``BatchPump.serve``'s ``ahead``; the worker says STARTED):
    it waits for the batch running, not for the one behind it too. Only jobs the fair order
    would serve before the other tenants' waiting ones go ahead, so a light tenant cannot take
    more than its share this way; a batch sent ahead waits for the previous one to start.

    One batch at a time while a quiet tenant waits beside a noisy one was measured and left
    out (MLP, batch 8, same-run A/B, docs/tenants.md): the quiet tenant's p99 0.64-0.69x at
    load 9-15, but at load 4-7 no better and the noisy tenant's requests/s 0.71-0.74x: the
    worker idles for the round trip between batches."""

    def __init__(
        self,
        depth: int,
        new_future: Callable[[], asyncio.Future[None]],
        on_idle: Callable[[Callable[[], int]], None] | None,
        queue: FairJobQueue,
    ) -> None:
        super().__init__(depth, new_future, on_idle)
        self.queue = queue
        # in flight, oldest first (and some settled, until they reach the front); sent ahead?
        self._sent: collections.deque[tuple[Batch, bool]] = collections.deque()
        self.ahead_batch: Batch | None = None  # the last batch sent ahead, until it settles
        # the pump's ``ahead``: also tried when a batch settles, for a tenant whose request
        # came while its previous one was in flight (then it was busy)
        self.send_ahead: Callable[[], bool] | None = None

    def sent(self, batch: Batch, ahead: bool) -> None:
        self._sent.append((batch, ahead))
        if ahead:
            self.ahead_batch = batch

    def ahead_waits(self) -> bool:
        """Whether a batch sent ahead has not started yet (the channel starts its clock when
        the worker starts it): the next one waits for that."""
        return self.ahead_batch is not None and self.ahead_batch.deadline is None

    def busy(self) -> set[str]:
        """The tenants with requests in flight to the worker in batches not sent ahead ("" for
        none): a tenant whose requests all went ahead may be sent ahead again."""
        return {
            "" if job.tenant is None else job.tenant.name
            for batch, ahead in self._sent
            if not ahead and batch.jobs is not None and not batch.future.done()
            for job in batch.jobs
        }

    def done(self, refill: bool = True) -> None:
        sent = self._sent
        while sent and sent[0][0].future.done():
            sent.popleft()
        if self.ahead_batch is not None and self.ahead_batch.future.done():
            self.ahead_batch = None
        super().done(refill)
        if refill and self.send_ahead is not None and self.queue.contended():
            self.send_ahead()  # before the gatherer wakes to take the queue's next

    @property  # type: ignore[override]
    def depth(self) -> int:
        return 2 if self.queue.contended() else self._most

    @depth.setter
    def depth(self, value: int) -> None:
        self._most = value


def pipeline_depth(batch_size: int) -> int:
    """Batches sent to one worker before the first is answered: two at least, so the next is
    waiting when one ends; more when batches are small, so that a burst of them travels in one
    write and the worker picks several up per wake-up (echo, batch 1, 16 connections: 2 -> 8
    in flight measured 1.2-1.5x the requests/s, interleaved A/B)."""
    return max(2, -(-IN_FLIGHT_REQUESTS // max(1, batch_size)))


def fail_jobs(jobs: list[Job], error: BaseException) -> None:
    for job in jobs:
        if not job.future.done():
            job.future.set_exception(error)
        elif job.stream is not None:  # a stream already under way breaks off
            job.stream.fail(error if isinstance(error, MserveError) else InternalError(str(error)))


def end_stream(stream: ChunkStream, result: Any, label: str) -> None:
    """The RESULT entry of a streamed request: its last chunk, or why the stream broke."""
    headers = result.headers
    if headers and headers[0][0] == STREAM_FAILED_HEADER:
        stream.fail(HandlerError(f"handler of {label} failed mid-stream: {headers[0][1]}"))
    elif headers and headers[0][0] == TOO_LARGE_HEADER:
        stream.fail(InternalError(f"the last chunk of {label} is {headers[0][1]} bytes, more"
                                  " than max_response_size_bytes"))  # fmt: skip
    else:
        stream.finish(bytes(result.body))
