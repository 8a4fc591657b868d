"""Streamed answers: HTTP/1.1 chunked transfer encoding, each chunk written as the worker sends
it, in order behind the answers a connection still owes, with the client's reading speed
passed back to the source (back-pressure).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from server.errors import MserveError
from server.http.answer import REASONS, http_date
from server.http.request import StreamSource

if TYPE_CHECKING:
    from server.http.connection import Connection
    from server.http.request import Request

log = logging.getLogger(__name__)


class ChunkedAnswer:
    """A streamed answer on a connection: HTTP/1.1 chunked transfer encoding, each chunk written
    as it comes (or held, in order, while an earlier answer on the connection is still owed).

    An HTTP/1.0 client cannot take chunked encoding: it gets the whole answer at the end, with
    a Content-Length, held in memory up to ``max_buffer_bytes`` (beyond it: ``too_large()``,
    its error answer). The same cap bounds chunks held behind an earlier answer.
    ``on_done(status, ok)`` is called once when the answer ends, breaks or its client leaves.
    """

    def __init__(
        self, conn: Connection, ex: Request, status: int, headers: list[list[str]],
        source: StreamSource, max_buffer_bytes: int,
        too_large: Callable[[], MserveError], on_done: Callable[[int, bool], None],
    ) -> None:  # fmt: skip
        self.conn = conn
        self.ex = ex
        self.status = status
        self.headers = headers
        self.source = source
        self.max_buffer_bytes = max_buffer_bytes
        self.too_large = too_large
        self.on_done = on_done
        self.state = "open"  # then "ended", "broken" or "gone"
        self.buffered = 0  # bytes held in ex.out, not written yet
        self._flush_handle: asyncio.Handle | None = None
        self.chunked = ex.version != "1.0"
        self._whole: list[bytes] = []  # HTTP/1.0: the answer so far
        if self.chunked:
            self._begin()
        else:
            ex.stream = self  # so that a client that leaves cancels it

    def _begin(self) -> None:
        conn, ex = self.conn, self.ex
        keep_alive = ex.keep_alive and not conn.closing_after(ex)
        lines = [f"HTTP/1.1 {self.status} {REASONS.get(self.status, 'Unknown')}\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in self.headers]
        lines.append(f"Transfer-Encoding: chunked\r\nDate: {http_date()}\r\nServer: mserve\r\n")
        if not keep_alive:
            lines.append("Connection: close\r\n")
        lines.append("\r\n")
        ex.out = ["".join(lines).encode("utf-8", "surrogateescape")]
        ex.status, ex.length, ex.keep_alive = self.status, 0, keep_alive
        ex.stream = self
        conn._flush()

    def chunk(self, data: bytes) -> None:
        if self.state != "open" or not data:  # an empty chunk would end the body
            return
        if not self.chunked:
            self._whole.append(data)
            self.buffered += len(data)
            if self.buffered > self.max_buffer_bytes:
                self._refuse()
            return
        ex = self.ex
        out = ex.out
        assert out is not None
        first = not ex.length
        ex.length += len(data)
        out.append(b"%x\r\n%b\r\n" % (len(data), data))
        self.buffered += len(data)
        conn = self.conn
        if first and conn.pending and conn.pending[0] is ex:
            conn._flush()  # the first chunk goes at once: time to first token
        elif conn.pending and conn.pending[0] is ex:
            # written at the end of this loop iteration: the chunks a worker sent together
            # leave in one system call, not one each (1,000 tiny chunks: 1 write, not 1,000)
            if self._flush_handle is None:
                self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)
        elif self.buffered > self.max_buffer_bytes:
            self._refuse()  # held behind an earlier answer, nothing of it written yet

    def _flush(self) -> None:
        self._flush_handle = None
        if self.state == "open":
            self.conn._flush()

    def end(self, last: bytes) -> None:
        if self.state != "open":
            return
        if not self.chunked:
            self._whole.append(last)
            body = b"".join(self._whole)
            self.state = "ended"
            if len(body) > self.max_buffer_bytes:
                self.conn.answer_error(self.ex, self.too_large())
                self.on_done(self.too_large().status, False)
                return
            self.conn.answer(self.ex, self.status, self.headers, body)
            self.on_done(self.status, True)
            return
        ex = self.ex
        ex.length += len(last)
        tail = b"%x\r\n%b\r\n0\r\n\r\n" % (len(last), last) if last else b"0\r\n\r\n"
        assert ex.out is not None
        ex.out.append(tail)
        self.state = "ended"
        self.on_done(self.status, True)
        self.conn._flush()

    def fail(self, error: MserveError) -> None:
        if self.state != "open":
            return
        if not self.chunked:  # nothing sent yet: the client gets the error as the answer
            self.state = "ended"
            self.conn.answer_error(self.ex, error)
            self.on_done(error.status, False)
            return
        log.warning(
            "streamed answer to %s %s broke after %d bytes: %s", self.ex.method,
            self.ex.target.decode("latin-1"), self.ex.length, error.message,
        )  # fmt: skip
        self.state = "broken"
        self.on_done(error.status, False)
        if self.conn.pending and self.conn.pending[0] is self.ex:
            self.conn._flush()
        elif self.ex.out is not None:  # not begun on the wire: it can still get its error
            self.ex.stream = None
            self.conn.answer_error(self.ex, error)

    def cancel(self) -> None:
        """The client went away."""
        if self.state != "open":
            return
        self.state = "gone"
        self.source.cancel()
        self.on_done(self.ex.status or self.status, False)

    def _refuse(self) -> None:
        """Too much to hold for a client that cannot take it yet: drop the stream, answer the
        error in its place (nothing of it was written)."""
        self.state = "ended"
        self.source.cancel()
        self._whole = []
        self.ex.stream = None
        error = self.too_large()
        self.conn.answer_error(self.ex, error)
        self.on_done(error.status, False)
