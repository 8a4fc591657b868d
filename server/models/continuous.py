"""Continuous batching (TorchServe's ``continuousBatching: true``): one worker, one step at a time.

The handler is called again and again. Each call (a step) gets the requests still generating,
sent again without their body (the handler keeps their state in ``context.cache``), plus new
ones from the queue up to ``batchSize``, taken as soon as they are there: a new request never
waits for the running ones to finish. After each call the worker asks the handler's
``context.stopping_criteria`` which requests are done; a request that goes on carries
TorchServe's ``ts_stream_next: true`` response header in the step's RESULT, and its answer of
that step becomes one chunk of its streamed response. A finished one ends its stream (or, done
in its first step, gets a plain answer) and frees its slot for the next step.

Between two steps the pump drops what nobody waits for: a client that went away (its stream
cancelled, or :meth:`Job.cancel`) or a request past its deadline. The worker sees the request
missing from the next step and cleans up its state (mserve_worker/continuous.py).

The model's inference log (server/inference_log/) gets what the ordinary pump gives it: each
request answered whole (done in its first step, or refused there) and each failed call. A
streamed answer is not logged, here as there: its body is never whole in the server.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from mserve_worker.protocol import RequestItem, ResponseItem
from server.errors import HandlerError, InternalError, WorkerDied, WorkerTimeout
from server.models.batching import Job, gather_batch
from server.models.pump import BatchPump, Retired, end_stream, fail_jobs
from server.streaming import ChunkStream
from server.workers.channel import ChannelClosed
from server.workers.process import Worker

log = logging.getLogger(__name__)

NEXT_HEADER = "ts_stream_next"  # TorchServe's response header: "true" while a request goes on


def _no_pause() -> None:
    """A step's chunks need no back-pressure on the worker: one chunk per request per step."""


class ContinuousPump(BatchPump):
    """Steps of one model's continuous-batching handler on one worker."""

    async def serve(self, worker: Worker, retire: asyncio.Event) -> str | None:
        """Run steps until retired (None) or the worker is lost (returns why)."""
        lost = asyncio.Event()
        reasons: list[str] = []
        retired = Retired(retire, self._others_serve, self.queue)

        def lost_while_idle() -> None:
            if not lost.is_set():
                lost.set()
                self.queue.wake_all()

        worker.on_lost(lost_while_idle)
        worker.on_chunk(functools.partial(self._chunk, worker))
        running: list[Job] = []
        size, timeout_s = self.settings.batch_size, self.settings.response_timeout_s
        delay_s = self.settings.max_batch_delay_ms / 1000
        try:
            while not lost.is_set():
                running = [job for job in running if not self._dropped(job)]
                new: list[Job] = []
                if not running:
                    jobs = await gather_batch(
                        self.queue, size, delay_s, retired, lost, load=lambda: 0
                    )
                    if jobs is None:
                        break
                    new = jobs
                elif not retired.is_set():  # join the running ones at once, never wait
                    while len(running) + len(new) < size:
                        job = self.queue.pop()
                        if job is None:
                            break
                        new.append(job)
                new = [job for job in new if not job.future.done()]
                _distinct_ids(running, new)
                step = running + new
                if not step:
                    continue
                running = []
                why = await self._step(worker, step, len(step) - len(new), timeout_s, running)
                if why is not None:
                    reasons.append(why)
                    break
        finally:
            for job in running:  # a lost worker took their state with it
                if not job.gone():
                    fail_jobs([job], WorkerDied(f"worker {worker.id} of {self.label} was lost"))
            worker.on_lost(None)
        if not reasons and not lost.is_set():
            return None
        return next((r for r in reasons if r), None) or await worker.ended()

    def _dropped(self, job: Job) -> bool:
        """Whether ``job`` leaves the running set before the next step: its client went away
        (counted here when no frontend counted it) or it was cancelled."""
        if job.cancelled is not None:
            return True
        if job.gone():
            if job.cancel("client"):
                self.stats.cancelled("client")
            return True
        return False

    async def _step(
        self, worker: Worker, step: list[Job], continuing: int, timeout_s: float,
        going_on: list[Job],
    ) -> str | None:  # fmt: skip
        """One handler call: send the step, hand out its answers; the requests that go on are
        added to ``going_on``. Why the worker is lost, if it is (its jobs have their answer or
        error by then)."""
        items = [_again(job.item) for job in step[:continuing]]
        items += [job.item for job in step[continuing:]]
        sent_at = time.monotonic()
        try:
            batch = worker.send_batch(items, timeout_s)
        except Exception as exc:  # the supervisor's task guard: never strand a caller
            log.exception("model %s: unexpected error sending a step", self.label)
            fail_jobs(step, InternalError(f"internal error sending the batch: {exc!r}"))
            await worker.kill()
            return f"unexpected error sending a step {exc!r}"
        batch.jobs = step
        for job in step:
            job.sent = (worker, batch)
            if not job.sent_at:
                job.sent_at = sent_at
        try:
            results = await worker.batch_result(batch, items)
        except HandlerError as exc:  # the call failed as a whole: every request of it ends
            fail_jobs(step, exc)
            if self.inference_log is not None:
                self.inference_log.failed(
                    [j.item for j in step], [j.enqueued_at for j in step], exc.status, exc.message
                )
            return None
        except ChannelClosed:  # never started: the new ones can go to another worker
            self.queue.requeue([job for job in step[continuing:] if not job.future.done()])
            fail_jobs(step[:continuing], WorkerDied(f"worker {worker.id} of {self.label} was lost"))
            return ""
        except (WorkerDied, WorkerTimeout) as exc:
            fail_jobs(step, exc)
            return exc.message
        whole = []  # answered in one piece (done in their first step, or refused)
        for job, result in zip(step, results, strict=True):
            if self._answer(job, result):
                going_on.append(job)
            elif job.stream is None:
                whole.append((job, result))
        if self.inference_log is not None and whole:
            self.inference_log.settled(
                [j.item for j, _ in whole], [r for _, r in whole],
                [j.enqueued_at for j, _ in whole], batch.future.result().meta.get("inference_log"),
            )  # fmt: skip
        started = time.perf_counter()
        handler_ms, entries = worker.result_metrics(batch)
        self.stats.batch_done(handler_ms, entries, step, time.perf_counter() - started)
        return None

    def _answer(self, job: Job, result: ResponseItem) -> bool:
        """One request's answer of a step: a chunk (it goes on: True), its end, or its error."""
        more = _take_next(result)
        if job.gone():
            return more  # the next step drops it, and counts it
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
            stream = job.stream = ChunkStream(
                result.status, result.content_type, result.headers, _no_pause, _no_pause
            )
            job.future.set_result(stream)  # type: ignore[arg-type]
        stream.push(bytes(result.body))
        return True


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


def _again(item: RequestItem) -> RequestItem:
    """A running request in a later step: its id and headers, no body (``cached``: the handler
    has its state), as TorchServe sends a request cached in the backend."""
    return RequestItem(
        item.request_id, "", item.headers, b"", item.params, item.op, item.api, cached=True
    )


def _take_next(result: ResponseItem) -> bool:
    """Whether the worker said the request goes on; the header itself is not the client's."""
    headers = result.headers
    for i, (name, value) in enumerate(headers):
        if name.lower() == NEXT_HEADER:
            del headers[i]
            return value.lower() == "true"
    return False
