"""Parent side of the frame stream to one worker, with batches pipelined.

The worker answers batches strictly in order, one at a time. Keeping a second batch already in
its socket while it runs the first means it never waits for the server's round trip between two
batches; the price is that a batch's clock (``response_timeout_s``) must start when the worker
*starts* it, which is when the batch ahead of it is answered, not when it was sent.

A batch sent "ahead" (server/models/pump.py: a tenant with nothing in flight while others'
batches wait in the worker) may be started before batches sent earlier that the worker had not
started; the worker then sends STARTED, and the batch moves to the head here, its clock started
and the one it passed waiting again, so the batches stay in the order the worker runs them.

It is an ``asyncio.Protocol`` rather than asyncio streams: a result resolves its batch's future
straight from ``data_received`` (no reader task to wake), and frames queued by several
dispatchers in one loop iteration leave in one write.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mserve_worker import protocol
from mserve_worker.protocol import Frame, Kind

# Enum members read per frame, bound once: on Python 3.11 ``Kind.RESULT`` goes through
# EnumType.__getattr__, ~65 ns a lookup against ~5 ns for a global (docs/explanations/costs.md).
_CHUNK, _STEP, _STARTED = Kind.CHUNK, Kind.STEP, Kind.STARTED
# what answers a sent frame, in order: a batch's RESULT or BATCH_FAILED, a reload step's
# RELOADED, a PARK's PARKED
_ANSWERS = (Kind.RESULT, Kind.BATCH_FAILED, Kind.RELOADED, Kind.PARKED)


class ChannelClosed(Exception):
    """The worker's end closed (it exited or was killed) before this batch was answered.

    ``started`` says whether the worker had begun the batch: a batch still waiting behind
    another never ran, so it can be given to another worker without any risk."""

    def __init__(self, started: bool) -> None:
        super().__init__("worker channel closed")
        self.started = started


class BatchExpired(Exception):
    """The batch ran longer than its timeout; the owner kills the worker."""


@dataclass(eq=False)
class Batch:
    batch_id: int
    size: int
    timeout_s: float
    future: asyncio.Future[Frame]
    deadline: float | None = None  # loop time; set when the worker starts the batch
    cancelled: int = 0  # requests whose callers left before the worker started the batch
    jobs: Any = None  # what the owner sent in it, in order (CHUNK frames name them by index)


class Channel(asyncio.Protocol):
    def __init__(self, max_payload_bytes: int) -> None:
        self._decoder = protocol.Decoder(max_payload_bytes)
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._control: collections.deque[Frame] = collections.deque()  # HELLO, READY, ...
        self._control_waiter: asyncio.Future[None] | None = None
        self._batches: collections.deque[Batch] = collections.deque()  # sent, in order
        # the future of every batch sent to a worker that runs continuous batching: they are
        # answered step by step in STEP frames, never as a whole
        self.no_answer: asyncio.Future[Frame] = self._loop.create_future()
        self.waiting = 0  # requests of sent batches the worker has not started yet
        # One timer for the head batch's deadline, re-armed only when it fires early: arming and
        # cancelling one per batch cost more than the rest of the batch's bookkeeping.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._out: list[bytes | bytearray | memoryview] = []
        self._flush_handle: asyncio.Handle | None = None
        self._paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.broken: str | None = None  # why the stream was dropped, if it broke the protocol
        self.serving = False  # the handshake is over: every frame must answer a batch
        self.on_lost: Callable[[], None] | None = None  # called once the connection is gone
        # called with the running batch and each CHUNK frame (streamed responses)
        self.on_chunk: Callable[[Batch, Frame], None] | None = None
        # called with each STEP frame, and each CHUNK frame sent in the middle of a step
        # (continuous batching run by the worker)
        self.on_step: Callable[[Frame], None] | None = None
        self._read_pauses = 0  # streams whose consumers cannot keep up (see pause_reading)
        # The worker runs every batch it is sent at once (an async handler with
        # asyncCommunication: mserve_worker/inflight.py), still answering them in order: none
        # waits, each batch's clock starts when it is sent, a CANCEL may reach any of them.
        self.concurrent = False

    # asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._decoder.feed(data)
        except protocol.ProtocolError as exc:
            self.broken = str(exc)
            self.close()
            return
        for frame in frames:
            if frame.kind is _CHUNK and self.on_step is not None:  # mid-step chunks
                self.on_step(frame)
                if self.broken is not None:
                    return
            elif frame.kind is _CHUNK:
                if not self._batches or self.on_chunk is None:
                    self.broken = "CHUNK frame while no batch runs"
                    self.close()
                    return
                self.on_chunk(self._batches[0], frame)  # the worker runs its batches in order
                if self.broken is not None:  # the chunk broke the protocol: nothing more counts
                    return
            elif frame.kind is _STEP and self.on_step is not None:
                self.on_step(frame)
                if self.broken is not None:
                    return
            elif frame.kind is _STARTED and not self.concurrent:
                self._started(frame.meta.get("batch_id"))
                if self.broken is not None:
                    return
            elif frame.kind in _ANSWERS and self._batches:
                batch = self._batches.popleft()
                if self._batches and not self.concurrent:  # the worker starts the next one now
                    head = self._batches[0]
                    self.waiting -= head.size - head.cancelled
                if not batch.future.done():
                    batch.future.set_result(frame)
                self._start_clock()
            elif self.serving:  # nobody reads control frames any more: they would pile up
                self.broken = f"{frame.kind.name} frame " + (
                    "while no batch runs"
                    if frame.kind in (Kind.RESULT, Kind.BATCH_FAILED)
                    else "after the handshake"
                )
                self.close()
                return
            else:
                self._control.append(frame)
                self._wake_control()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake_control()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for i, batch in enumerate(self._batches):
            if not batch.future.done():
                batch.future.set_exception(ChannelClosed(started=i == 0 or self.concurrent))
        self._batches.clear()
        self.waiting = 0
        self.resume_writing()
        if self.on_lost is not None:
            self.on_lost()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # frames -------------------------------------------------------------------------------

    async def next_control(self) -> Frame | None:
        """The next frame that answers no batch (the handshake's); None once closed."""
        while not self._control:
            if self.closed:
                return None
            self._control_waiter = self._loop.create_future()
            await self._control_waiter
        return self._control.popleft()

    def start_serving(self) -> None:
        """The handshake is over (READY was read): from now on a frame that answers no batch
        breaks the protocol, one already queued included."""
        self.serving = True
        if self._control:
            self.broken = f"{self._control[0].kind.name} frame after the handshake"
            self._control.clear()
            self.close()

    def send(self, frame: Frame) -> None:
        """Queue a frame; everything queued in one loop iteration goes out in one write."""
        if self.closed:
            return
        self._out.extend(protocol.encode_for_send(frame))
        if self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._flush)

    def flush_now(self) -> None:
        """Write what is queued now, not at the end of the loop iteration (a batch sent ahead:
        a loop iteration of a busy frontend is long enough for the worker to start the batch
        it should have passed)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self._flush()

    def submit(self, batch_id: int, frame: Frame, size: int, timeout_s: float) -> Batch:
        """Send a batch frame; its future gets the RESULT or BATCH_FAILED frame, or
        :class:`ChannelClosed` / :class:`BatchExpired`."""
        batch = Batch(batch_id, size, timeout_s, self._loop.create_future())
        if self.closed:
            batch.future.set_exception(ChannelClosed(started=False))
            return batch
        if self._batches and not self.concurrent:
            self.waiting += size
        self._batches.append(batch)
        self.send(frame)
        if self.concurrent:
            batch.deadline = self._loop.time() + timeout_s
            if self._timer is None or batch.deadline < self._timer_at:
                self._arm(batch.deadline)
        elif len(self._batches) == 1:
            self._start_clock()
        return batch

    def cancel(self, batch: Batch, request_ids: list[str]) -> None:
        """Tell the worker to skip requests of a batch it has not started (callers gone)."""
        if self.concurrent:  # it runs already: its callers that left are told as a stream's
            self.cancel_running(batch, request_ids)
        elif not self.closed and batch in self._batches and self._batches[0] is not batch:
            self.send(protocol.cancel_frame(batch.batch_id, request_ids))
            batch.cancelled += len(request_ids)  # they no longer wait: job_queue_size frees up
            self.waiting -= len(request_ids)

    def cancel_running(self, batch: Batch, request_ids: list[str]) -> None:
        """Tell the worker that callers of the batch it runs left mid-stream: it stops sending
        their chunks (and stops their generators)."""
        running = self._batches and (
            self._batches[0] is batch or (self.concurrent and batch in self._batches)
        )
        if not self.closed and running:
            self.send(protocol.cancel_frame(batch.batch_id, request_ids))

    async def drain(self) -> None:
        if self._paused and not self.closed:
            self._drain_waiter = self._loop.create_future()
            await self._drain_waiter

    def pause_reading(self) -> None:
        """Stop reading the worker's frames (a streamed response's client cannot keep up): its
        sends block, so its handler waits. Counted: reading resumes when every pause is."""
        self._read_pauses += 1
        if self._read_pauses == 1 and self._transport is not None and not self.closed:
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._read_pauses -= 1
        if self._read_pauses == 0 and self._transport is not None and not self.closed:
            self._transport.resume_reading()

    @property
    def writable(self) -> bool:
        """Whether a frame sent now is written without waiting for the worker to read."""
        return not self._paused and not self.closed

    @property
    def in_flight(self) -> int:
        return len(self._batches)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection now, unsent frames included: the worker is gone."""
        if self._transport is not None:
            self._transport.abort()

    # internals ----------------------------------------------------------------------------

    def _flush(self) -> None:
        self._flush_handle = None
        if self._out and not self.closed and self._transport is not None:
            out, self._out = self._out, []
            self._transport.writelines(out)

    def _wake_control(self) -> None:
        if self._control_waiter is not None and not self._control_waiter.done():
            self._control_waiter.set_result(None)

    def _started(self, batch_id: Any) -> None:
        """STARTED: the worker runs batch ``batch_id`` now, ahead of the head batch (which it
        had not started): that batch becomes the head, its clock starts and the one it passed
        waits again. A STARTED for the head is a no-op; for no batch sent, a broken protocol."""
        batches = self._batches
        if batches and batches[0].batch_id == batch_id:
            return
        batch = next((b for b in batches if b.batch_id == batch_id), None)
        if batch is None:
            self.broken = f"STARTED for batch {batch_id!r}, which is not waiting in the worker"
            self.close()
            return
        passed = batches[0]
        batches.remove(batch)
        batches.appendleft(batch)
        self.waiting += passed.size - passed.cancelled - (batch.size - batch.cancelled)
        passed.deadline = None
        self._start_clock()

    def _start_clock(self) -> None:
        """The head batch is the one the worker runs now: its timeout starts here."""
        if not self._batches:
            return
        head = self._batches[0]
        if head.deadline is None:
            head.deadline = self._loop.time() + head.timeout_s
            if self._timer is None or head.deadline < self._timer_at:
                self._arm(head.deadline)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._check_deadline)
        self._timer_at = when

    def _check_deadline(self) -> None:
        """The timer fired: expire the head batch if its time is up, else wait for its deadline
        (the batch it was armed for was answered in time)."""
        self._timer = None
        if not self._batches or self.closed:
            return
        head = self._batches[0]
        if self.concurrent:  # every batch runs: the first past its deadline, else the next
            head = min(self._batches, key=lambda b: b.deadline or 0.0)
        if head.deadline is None:  # never: a head's clock starts when it becomes the head
            return
        if self._loop.time() >= head.deadline:
            if not head.future.done():
                head.future.set_exception(BatchExpired())
            return
        self._arm(head.deadline)
