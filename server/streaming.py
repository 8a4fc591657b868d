"""Streamed responses, server side: one request's chunks, from its worker to whichever frontend
answers the request.

A job whose handler streams gets, in place of its answer, a :class:`ChunkStream` as the result of
its future, as soon as the first chunk arrives. The frontend then either attaches a consumer
(:meth:`ChunkStream.attach`, with ``chunk`` / ``end`` / ``fail`` callbacks: the HTTP server's
chunked answer) or reads it as an async iterator (:meth:`ChunkStream.chunks`, for a gRPC
server-streaming call). Both apply back-pressure the same way: a consumer that cannot keep up
pauses reading from the worker's channel, so the worker's own sends block and the handler waits;
nothing is buffered without bound in the server.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from server.errors import MserveError

# Chunks held for a consumer that has not caught up (not attached yet, or an async iterator not
# read): past this, the worker's channel is paused until they are taken.
BACKLOG_BYTES = 256 * 1024


class StreamConsumer(Protocol):
    def chunk(self, data: bytes) -> None:
        """One more piece of the answer, in order."""

    def end(self, last: bytes) -> None:
        """The handler finished: ``last`` (maybe empty) is the final piece."""

    def fail(self, error: MserveError) -> None:
        """The stream broke after it began (handler error, timeout, worker death)."""


class StreamMeter(Protocol):
    """What a stream's chunks cost its sender (server/tenants/tokens.py's Usage)."""

    def chunk(self, data: bytes) -> None: ...

    def ended(self) -> None: ...


class ChunkStream:
    """The chunks of one request's response. ``status``, ``content_type`` and ``headers`` are
    what the handler had set when it sent the first chunk."""

    def __init__(
        self,
        status: int,
        content_type: str,
        headers: list[list[str]],
        pause: Callable[[], None],
        resume: Callable[[], None],
        on_cancel: Callable[[], None] | None = None,
    ) -> None:
        self.status = status
        self.content_type = content_type
        self.headers = headers
        self.finished = False  # ended, failed or cancelled: nothing more is delivered
        self.cancelled = False
        self.chunks_in = 0
        self.bytes_in = 0
        self._pause_source = pause
        self._resume_source = resume
        self._on_cancel = on_cancel  # tells the worker to stop the request's stream
        self._paused = False
        self._consumer: StreamConsumer | None = None
        # what arrived before a consumer: ("chunk", bytes) / ("end", bytes) / ("fail", error)
        self._backlog: collections.deque[tuple[str, object]] = collections.deque()
        self._backlog_bytes = 0
        # the answer kept for the inference log (record_to), and who gets it when it ends
        self._kept: bytearray | None = None
        self._keep_limit = 0
        self._on_end: Callable[[ChunkStream, bytes, MserveError | None], None] | None = None
        # told of each chunk as it comes from the worker, and of the end (a tenant's quotas)
        self.meter: StreamMeter | None = None

    def record_to(
        self, limit: int, on_end: Callable[[ChunkStream, bytes, MserveError | None], None]
    ) -> None:
        """Keep the answer's first ``limit`` bytes as they pass and give them to ``on_end``
        once the stream ends, finished, broken (with its error) or cancelled (``cancelled``
        set): a sampled request's inference log record. Chunks are still never held back."""
        self._kept = bytearray()
        self._keep_limit = limit
        self._on_end = on_end

    # worker side (the model) ----------------------------------------------------------------

    def push(self, data: bytes) -> None:
        if self.finished:
            return
        self.chunks_in += 1
        self.bytes_in += len(data)
        if self.meter is not None:
            self.meter.chunk(data)
        if self._kept is not None:
            self._keep(data)
        consumer = self._consumer
        if consumer is not None:
            consumer.chunk(data)
            return
        self._backlog.append(("chunk", data))
        self._backlog_bytes += len(data)
        if self._backlog_bytes > BACKLOG_BYTES:
            self.pause()

    def finish(self, last: bytes) -> None:
        if self.finished:
            return
        if last:  # the client gets it as one chunk more
            self.chunks_in += 1
            if self.meter is not None:
                self.meter.chunk(last)
        self.bytes_in += len(last)
        if self._kept is not None:
            self._keep(last)
        self._close(("end", last))
        self._ended(None)

    def fail(self, error: MserveError) -> None:
        if self.finished:
            return
        self._close(("fail", error))
        self._ended(error)

    # consumer side (a frontend) -------------------------------------------------------------

    def attach(self, consumer: StreamConsumer) -> None:
        """Deliver everything so far, then each event as it comes, to ``consumer``."""
        backlog, self._backlog = self._backlog, collections.deque()
        self._backlog_bytes = 0
        self._consumer = None if self.cancelled else consumer
        for kind, value in backlog:
            if self.cancelled:
                return
            _deliver(consumer, kind, value)
        if not self.finished:
            self.resume()

    def pause(self) -> None:
        """The consumer cannot take more now: stop reading from the worker."""
        if not self._paused and not self.finished:
            self._paused = True
            self._pause_source()

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            self._resume_source()

    def cancel(self) -> None:
        """The caller went away: drop what is left of the stream, and tell the worker, which
        stops sending its chunks (and closes its generator); chunks already under way are read
        and discarded, so the worker is never held up by a gone client."""
        self.cancelled = True
        self._consumer = None
        self._backlog.clear()
        if not self.finished:
            self.finished = True
            self.resume()
            if self._on_cancel is not None:
                self._on_cancel()
            self._ended(None)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The chunks as an async iterator, the last one included when it is not empty; raises
        the stream's error if it breaks. Closing it early (``contextlib.aclosing``, or the
        reading task being cancelled, as a gRPC call is when its client leaves) cancels the
        stream."""
        reader = _Reader(self)
        self.attach(reader)
        try:
            while True:
                item = await reader.next()
                if item is None:
                    return
                yield item
        finally:
            if not self.finished:
                self.cancel()

    # internals ------------------------------------------------------------------------------

    def _keep(self, data: bytes) -> None:
        assert self._kept is not None
        room = self._keep_limit - len(self._kept)
        if room > 0:
            self._kept += data[:room]

    def _ended(self, error: MserveError | None) -> None:
        if self.meter is not None:
            self.meter.ended()
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            kept, self._kept = self._kept, None
            on_end(self, bytes(kept or b""), error)

    def _close(self, event: tuple[str, object]) -> None:
        consumer = self._consumer
        if consumer is None:
            self._backlog.append(event)
            self.finished = True
            self.resume()
            return
        self.finished = True
        self._consumer = None
        self.resume()
        _deliver(consumer, *event)


def _deliver(consumer: StreamConsumer, kind: str, value: object) -> None:
    if kind == "chunk":
        consumer.chunk(value)  # type: ignore[arg-type]
    elif kind == "end":
        consumer.end(value)  # type: ignore[arg-type]
    else:
        consumer.fail(value)  # type: ignore[arg-type]


class _Reader:
    """The consumer behind :meth:`ChunkStream.chunks`: holds chunks until the iterator takes
    them, pausing the stream while it holds more than ``BACKLOG_BYTES``."""

    def __init__(self, stream: ChunkStream) -> None:
        self._stream = stream
        self._items: collections.deque[bytes | None] = collections.deque()
        self._bytes = 0
        self._error: MserveError | None = None
        self._waiter: asyncio.Future[None] | None = None

    def chunk(self, data: bytes) -> None:
        self._items.append(data)
        self._bytes += len(data)
        if self._bytes > BACKLOG_BYTES:
            self._stream.pause()
        self._wake()

    def end(self, last: bytes) -> None:
        if last:
            self._items.append(last)
        self._items.append(None)
        self._wake()

    def fail(self, error: MserveError) -> None:
        self._error = error
        self._wake()

    async def next(self) -> bytes | None:
        while not self._items:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        item = self._items.popleft()
        if item is not None:
            self._bytes -= len(item)
            if self._bytes <= BACKLOG_BYTES // 2:
                self._stream.resume()
        return item

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
