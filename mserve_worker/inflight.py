"""Several batches of an ``async def handle`` at once, as TorchServe's async worker runs them.

TorchServe's async worker (``ts/async_service.py``, ``asyncCommunication: true``) schedules each
batch's coroutine on its event loop as the batch arrives and answers each when it is done, so a
handler that awaits (an engine such as vLLM's, a remote call, a sleep) serves many requests at
once. Here each batch the server sends gets a thread that runs the whole per-batch path of
:meth:`HandlerService.serve` (decode, the handler call, encode) on a context of its own; the
handler's coroutines all run on the worker's one event loop (:mod:`.coroutines`), where they
interleave. How many run at once is bounded by how many batches the server keeps in the worker
(its pipeline depth; server/models/pump.py) and by ``MAX_BATCHES`` here.

The server reads a worker's answers, and the chunks of streamed ones, for its batches in the
order it sent them (server/workers/channel.py). :class:`Sequencer` keeps that order: a batch
that ends before an earlier one holds its RESULT, and its chunks, until the earlier ones are
answered. So the work overlaps, and a short request behind a long one waits for the long one's
answer before its own goes out. A batch whose callers have all left (their CANCELs read) has its
coroutine cancelled: the handler sees ``asyncio.CancelledError`` at its ``await``, so an engine
it waits on can stop, and the batch is answered 499, which nobody reads.

Runs inside the model's own environment: standard library only, Python 3.8.
"""

from __future__ import annotations

import collections
import functools
import threading
import traceback
from collections.abc import Callable
from typing import Any

from . import streaming
from .channel import Channel
from .protocol import Frame, Kind, ProtocolError, parse_batch, parse_reload, reloaded_frame

# Batches run at once at most, whatever the server sends (it sends fewer: its pipeline depth).
MAX_BATCHES = 256
# Chunks a streaming batch may hold back while an earlier batch runs, in bytes: past this its
# handler's send fails (the worker's memory is bounded; the earlier batch is still running).
HELD_CHUNK_BYTES = 64 * 1024 * 1024


class Sequencer:
    """Sends each batch's frames in the order the batches arrived: the head batch's at once,
    a later batch's once every earlier one is answered."""

    def __init__(self, send: Callable[[Frame], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._order: collections.deque[int] = collections.deque()  # batch ids, as they came
        self._held: dict[int, list[Frame]] = {}
        self._held_bytes: dict[int, int] = {}
        self._answered: set[int] = set()  # held RESULTs: their batch is done

    def open(self, batch_id: int) -> None:
        with self._lock:
            self._order.append(batch_id)
            self._held[batch_id] = []
            self._held_bytes[batch_id] = 0

    def chunk(self, batch_id: int, frame: Frame) -> None:
        """A CHUNK of ``batch_id``: sent now when it is the head batch, else held."""
        with self._lock:
            if self._order and self._order[0] == batch_id:
                self._send(frame)
                return
            size = self._held_bytes[batch_id] + len(frame.payload)
            if size > HELD_CHUNK_BYTES:
                raise RuntimeError(
                    f"this request's chunks waiting behind an earlier batch passed "
                    f"{HELD_CHUNK_BYTES} bytes; answers go out in the order requests came"
                )
            self._held_bytes[batch_id] = size
            self._held[batch_id].append(frame)

    def answer(self, batch_id: int, frame: Frame) -> None:
        """The batch's RESULT (or BATCH_FAILED): sent when every earlier batch is answered,
        with what the batches after it held that can go too."""
        with self._lock:
            self._held[batch_id].append(frame)
            self._answered.add(batch_id)
            while self._order:
                head = self._order[0]
                for held in self._held[head]:
                    self._send(held)
                self._held[head] = []
                self._held_bytes[head] = 0
                if head not in self._answered:
                    break
                self._order.popleft()
                del self._held[head], self._held_bytes[head]
                self._answered.discard(head)


def run(channel: Channel, service: Any, answer: Callable[..., Frame]) -> None:
    """Read frames until the server closes the channel, each batch run in a thread of its own;
    returns once the batches under way are answered. ``answer(serve, service, batch_id, items,
    cancelled)`` is the runtime's: a batch's RESULT or BATCH_FAILED frame."""
    send_lock = threading.Lock()

    def send(frame: Frame) -> None:  # one frame at a time on the socket, from any thread
        with send_lock:
            channel.send(frame)

    sequencer = Sequencer(send)
    slots = threading.BoundedSemaphore(MAX_BATCHES)
    running: set[threading.Thread] = set()
    running_lock = threading.Lock()

    def settle_all() -> None:
        with running_lock:
            threads = list(running)
        for thread in threads:
            thread.join()

    def start(batch_id: int, items: list[Any], cancelled: Any) -> None:
        def target() -> None:
            try:
                _run_batch(service, sequencer, channel, answer, batch_id, items, cancelled)
            finally:
                with running_lock:
                    running.discard(thread)
                slots.release()

        thread = threading.Thread(target=target, name=f"batch-{batch_id}", daemon=True)
        with running_lock:
            running.add(thread)
        thread.start()

    try:
        while True:
            frame = channel.receive()
            if frame is None:
                break
            if frame.kind == Kind.RELOAD:  # hot reload: after the batches under way
                settle_all()
                send(reloaded_frame(service.reloader.step(*parse_reload(frame))))
                continue
            if frame.kind != Kind.BATCH:
                raise ProtocolError(f"unexpected {frame.kind.name} frame after INIT")
            batch_id, items = parse_batch(frame)
            cancelled = channel.cancelled(batch_id, forget_older=False)
            slots.acquire()  # at the bound, CANCELs and later batches wait in the socket
            sequencer.open(batch_id)
            start(batch_id, items, cancelled)
    finally:
        settle_all()


def _run_batch(
    service: Any,
    sequencer: Sequencer,
    channel: Channel,
    answer: Callable[..., Frame],
    batch_id: int,
    items: list[Any],
    cancelled: Any,
) -> None:
    """One batch on a context of its own; whatever happens, the batch is answered (a failure
    of ours fails the batch, as a handler's does, and the worker serves on)."""
    stream = streaming.Stream(functools.partial(sequencer.chunk, batch_id), channel.cancelled_now)
    callers = {item.request_id for item in items} - set(cancelled)
    try:
        view = service.apart(stream)
        # a client that leaves (or passes its deadline) makes the server send a CANCEL; once
        # every caller of this batch has, its coroutine is cancelled (coroutines.settle)
        view.context._mserve_abandoned = lambda: callers <= channel.cancelled_now(batch_id)  # type: ignore[attr-defined]
        reply = answer(view.serve, view, batch_id, items, cancelled)
    except BaseException as exc:  # the batch's boundary: never leave the server waiting
        traceback.print_exc()
        error = f"internal error running the batch: {type(exc).__name__}: {exc}"
        reply = Frame(Kind.BATCH_FAILED, {"error": error, "traceback": "", "batch_id": batch_id})
    finally:
        channel.forget(batch_id)
    sequencer.answer(batch_id, reply)
