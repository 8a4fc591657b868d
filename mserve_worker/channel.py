"""The worker's end of its channel to the server: blocking frame I/O over the inherited socket,
with the CANCELs the server sends set aside by batch, so that the loop (:mod:`.runtime`, or
:mod:`.continuous` for a continuous-batching handler) and a streaming handler's sends can ask
which of their requests' callers left.

A BATCH whose meta says ``"ahead": true`` (the server's fair queue sends one for a tenant that
had nothing in flight while others' batches wait here, docs/tenants.md) is run before the
batches received ahead of it that have not started; the worker tells the server with a
STARTED frame when it takes one out of order.

Runs inside the model's own environment: standard library only, Python 3.8.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Collection
from typing import Any

from .protocol import Decoder, Frame, Kind, encode, parse_cancel, started_frame

_BATCH = Kind.BATCH
# A frame held here that waited behind another is run after a look at the socket for what came
# meanwhile (CANCELs, a batch sent ahead), unless the socket was read less than this ago: with
# eight requests in flight, reading before every batch was one failing recv() per request for a
# window of a few hundred microseconds.
POLL_AFTER_S = 0.001

_RECV_BYTES = 1 << 18
# How often a streaming handler's sends look for CANCELs of its own batch (clients that left).
_STREAM_POLL_S = 0.01
_NONE_CANCELLED: frozenset[str] = frozenset()


class Channel:
    """Blocking frame I/O over the inherited socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.decoder = Decoder()
        self.pending: list[Frame] = []
        self.buffered = False  # the last frame received had arrived with an earlier one
        self.read_at = 0.0  # when the socket was last looked at
        self._cancelled: dict[int, set[str]] = {}  # batch id -> request ids whose callers left
        self._eof = False
        # the server has sent a batch marked "ahead": from then on the next batch is chosen
        # among those held (_ahead_first; before, the choice costs nothing)
        self.ahead_seen = False
        # one reused buffer: a fresh 256 KiB bytes per recv costs page faults on every call
        self._buffer = bytearray(_RECV_BYTES)
        self._view = memoryview(self._buffer)

    def send(self, frame: Frame) -> None:
        """Header, meta and payload in one ``sendmsg``: one system call, and the payload is
        written from where it lies, never joined to the header."""
        buffers: list[Any] = encode(frame)
        while buffers:  # a blocking send stops short only when a signal interrupts it
            sent = self.sock.sendmsg(buffers)
            while buffers and sent >= len(buffers[0]):
                sent -= len(buffers.pop(0))
            if sent:
                buffers[0] = memoryview(buffers[0])[sent:]

    def receive(self) -> Frame | None:
        """The next frame other than CANCEL, or None when the server closed the channel."""
        self.buffered = bool(self.pending)
        if self.buffered and time.monotonic() - self.read_at > POLL_AFTER_S:
            self.poll()  # it waited behind another: CANCELs, or a batch sent ahead, may have come
        while not self.pending:
            if self._eof:
                return None
            n = self.sock.recv_into(self._buffer)
            if not n:
                return None
            self.read_at = time.monotonic()
            self._take(self.decoder.feed(self._view[:n]))
        if self.ahead_seen and len(self.pending) > 1:
            self._ahead_first()
        return self.pending.pop(0)

    def poll(self) -> None:
        """Take in what has already arrived, without waiting: a CANCEL for a batch that was
        queued here while the one before it ran."""
        self.read_at = time.monotonic()
        while not self._eof:
            try:
                n = self.sock.recv_into(self._buffer, 0, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            if not n:
                self._eof = True  # the next receive() reports it, after the frames we hold
                return
            self._take(self.decoder.feed(self._view[:n]))

    def cancelled(self, batch_id: int, forget_older: bool = True) -> Collection[str]:
        """Request ids of ``batch_id`` the server cancelled; forgets older batches' leftovers
        (not when older batches may still run: :mod:`.inflight`, which forgets each batch's
        when it ends)."""
        if not self._cancelled:
            return _NONE_CANCELLED
        for stale in [b for b in self._cancelled if b < batch_id] if forget_older else ():
            del self._cancelled[stale]
        return self._cancelled.pop(batch_id, set())

    def cancelled_now(self, batch_id: int) -> set[str]:
        """Request ids of the running batch ``batch_id`` whose callers left, as far as the
        frames read so far tell, without reading the socket: for threads other than the one
        that reads it (:mod:`.inflight`)."""
        return set(self._cancelled.get(batch_id, ())) if self._cancelled else set()

    def forget(self, batch_id: int) -> None:
        """The batch ended: its CANCELs no longer matter."""
        self._cancelled.pop(batch_id, None)

    def gone(self, batch_id: int) -> set[str]:
        """Request ids of the running batch ``batch_id`` whose callers left mid-stream; looks at
        the socket (without waiting) at most once per ``_STREAM_POLL_S``."""
        if time.monotonic() - self.read_at >= _STREAM_POLL_S:
            self.poll()
        return self._cancelled.get(batch_id, set()) if self._cancelled else set()

    def take_pending(self) -> list[Frame]:
        """The frames other than CANCEL received so far, without waiting (after ``poll``)."""
        frames, self.pending = self.pending, []
        return frames

    def take_cancelled(self) -> dict[int, set[str]]:
        """Every CANCEL received so far, by batch id, forgotten here."""
        cancelled, self._cancelled = self._cancelled, {}
        return cancelled

    def _ahead_first(self) -> None:
        """A BATCH marked ``"ahead"`` that arrived behind batches not yet started (with no other
        kind of frame between, which keeps its place) goes to the front, and the server is told
        with a STARTED frame that the worker runs it now (it keeps its batches in the order
        they run)."""
        pending = self.pending
        for i, frame in enumerate(pending):
            if frame.kind is not _BATCH:
                return
            if i and frame.meta.get("ahead") is True:
                del pending[i]
                pending.insert(0, frame)
                self.send(started_frame(frame.meta.get("batch_id")))  # ProtocolError if bad
                return

    def _take(self, frames: list[Frame]) -> None:
        for frame in frames:
            if frame.kind == Kind.CANCEL:
                batch_id, ids = parse_cancel(frame)
                self._cancelled.setdefault(batch_id, set()).update(ids)
            else:
                if frame.kind is _BATCH and frame.meta.get("ahead") is True:
                    self.ahead_seen = True
                self.pending.append(frame)
