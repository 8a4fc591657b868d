"""One client connection and its flow: httptools feeds it bytes, it gathers each request, hands
it to the server's router, and writes the answers strictly in the order the requests came
(pipelining), pausing reading while the client reads its answers slowly or too many requests
are in flight (back-pressure); keep-alive and idle timeouts; after a refusal it reads and drops
what the client still sends before it closes, so that the client reads the refusal.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import httptools

from server.errors import (
    BadRequest,
    InternalError,
    MserveError,
    RequestTooLarge,
    ServiceUnavailable,
)
from server.http.answer import JSON, LARGE_BODY, REASONS, Answer, error_body, http_date, json_answer
from server.http.linger import LINGER_BYTES, Linger
from server.http.request import (
    KNOWN_HEADERS,
    MAX_HEAD_BYTES,
    HeadTooLarge,
    Request,
    framing_refusal,
)

if TYPE_CHECKING:
    from server.accesslog import AccessLogFile

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 32  # requests of one connection being served; reading pauses beyond it


class Listener(Protocol):
    """What a connection needs of the listener that accepted it (server/http/server.py's
    HttpServer): its limits and timeouts, where requests go, and where answers are counted."""

    connections: set[Connection]
    max_connections: int
    max_request_bytes: int
    read_timeout_s: float
    keepalive_s: float
    stopping: bool
    tasks: set[asyncio.Future[Answer]]
    access_log: AccessLogFile | None
    on_answer: Callable[[int], None] | None
    redact: Callable[[str], str] | None

    def refused(self) -> None: ...
    def dispatch(self, conn: Connection, req: Request) -> None: ...


class Connection(asyncio.Protocol):
    """One client connection: httptools parses, exchanges are answered strictly in order."""

    def __init__(self, api: Listener) -> None:
        self.api = api
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.remote = "-"
        self.pending: collections.deque[Request] = collections.deque()
        self.last_active = time.monotonic()
        self.closing = False  # no more requests are read; close once pending ones are written
        self._current: Request | None = None  # the request being received, once its head is
        self._receiving = False  # a request has begun arriving
        self._began = 0.0  # when it did
        self._url: list[bytes] = []
        self._headers: list[list[str]] = []
        self._known: dict[str, str] = {}
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._read_paused = False
        self._write_paused = False
        self._linger: Linger | None = None  # refused: reading and dropping the rest, then close
        self._parser_ok = True  # httptools has not failed on this connection

    # asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.remote = str(peer[0])
        if len(self.api.connections) >= self.api.max_connections:
            self.api.refused()
            transport.close()
            return
        self.api.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            if self._linger is not None:
                self._drop(data)
            return
        self.last_active = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # llhttp stops after a request that asks to switch protocols; it was refused, or
            # answered as HTTP/1.1 with the connection closing after it (_framing_refusal)
            self._parser_ok = False
            if not self.closing:
                self._reject(BadRequest("protocol upgrades (WebSocket, h2c) are not supported"))
        except httptools.HttpParserError as exc:
            self._parser_ok = False
            if not self.closing:  # not one of our own rejections from a callback
                self._reject(BadRequest(f"malformed HTTP request: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self.api.connections.discard(self)
        for ex in self.pending:  # queued requests of a gone client cost no worker time
            if ex.future is not None and not ex.future.done():
                ex.future.cancel()
            elif ex.stream is not None:
                ex.stream.cancel()
        self.pending.clear()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()
        if self.pending and self.pending[0].stream is not None:
            self.pending[0].stream.source.pause()  # its client reads slowly: so does the worker

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()
        if self.pending and self.pending[0].stream is not None:
            self.pending[0].stream.source.resume()

    # httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._receiving = True
        self._began = time.monotonic()
        self._url = []
        self._headers = []
        self._known = {}
        self._head_bytes = 0
        self._body = []
        self._body_bytes = 0
        self._current = None

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        self._grow_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES:
            self._grow_head(0)  # refuses it
        if self.closing:
            return
        key = name.decode("utf-8", "surrogateescape")
        text = value.decode("utf-8", "surrogateescape")
        self._headers.append([key, text])
        lower = key.lower()
        if lower in KNOWN_HEADERS and lower not in self._known:
            self._known[lower] = text

    def on_headers_complete(self) -> None:
        if self.closing:
            return
        parser = self.parser
        ex = self._current = Request(
            parser.get_method().decode("ascii", "replace"),
            b"".join(self._url),
            parser.get_http_version(),
            parser.should_keep_alive(),
        )
        ex.headers = self._headers
        ex.known = self._known
        refusal = framing_refusal(ex, parser.should_upgrade())
        if refusal is not None:
            self._reject(refusal, ex)
            return
        known = ex.known  # header(), without its lower() for names we spell in lower case
        length = known.get("content-length")
        limit = self.api.max_request_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            self._reject(RequestTooLarge(
                f"request body is {length} bytes, more than max_request_size_bytes={limit}"
            ), ex, linger=int(length) <= LINGER_BYTES)  # fmt: skip
            return
        if (known.get("expect") or "").lower() == "100-continue" and not self.pending:
            self._write([b"HTTP/1.1 100 Continue\r\n\r\n"])

    def on_body(self, body: bytes) -> None:
        if self.closing:
            return
        self._body_bytes += len(body)
        if self._body_bytes > self.api.max_request_bytes:
            self._reject(RequestTooLarge(
                "request body is larger than max_request_size_bytes="
                f"{self.api.max_request_bytes}"
            ), self._current)  # fmt: skip
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._receiving = False
        ex = self._current
        self._current = None
        if self._linger is not None:  # the refused request's body has all come (and was dropped)
            self._stop_lingering()
            return
        if self.closing or ex is None:
            return
        ex.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        self.pending.append(ex)
        if not ex.keep_alive:
            self.closing = True  # the client's last request
        self.api.dispatch(self, ex)
        self._update_reading()

    # answers ---------------------------------------------------------------------------

    def answer(
        self, ex: Request, status: int, headers: list[list[str]],
        body: bytes | bytearray | memoryview,
    ) -> None:  # fmt: skip
        """Encode the answer of ``ex``; it is written once those before it are."""
        keep_alive = ex.keep_alive and not self.closing_after(ex)
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in headers]
        lines.append(f"Content-Length: {len(body)}\r\nDate: {http_date()}\r\nServer: mserve\r\n")
        if not keep_alive:
            lines.append("Connection: close\r\n")
        elif ex.version == "1.0":
            lines.append("Connection: keep-alive\r\n")
        lines.append("\r\n")
        head = "".join(lines).encode("utf-8", "surrogateescape")
        if ex.method == "HEAD":
            ex.out = [head]
        elif len(body) < LARGE_BODY:
            ex.out = [head + body]
        else:
            ex.out = [head, body]
        ex.status, ex.length = status, len(body)
        ex.keep_alive = keep_alive
        self._flush()

    def answer_json(self, ex: Request, status: int, payload: Any) -> None:
        self.answer(ex, *json_answer(status, payload))

    def answer_error(self, ex: Request, error: MserveError) -> None:
        headers = [["Content-Type", JSON], *([k, v] for k, v in error.headers().items())]
        if ex.tag is not None:  # a prediction's error names its request id, as its answer would
            headers.append(["X-Request-Id", ex.tag[0]])
        redact = self.api.redact
        body = error_body(ex.parts, error, redact(error.message) if redact else error.message)
        self.answer(ex, error.status, headers, json.dumps(body).encode())

    def answer_later(self, req: Request, work: Awaitable[Answer]) -> None:
        """Answer with what ``work`` returns (management calls that wait on workers). It runs to
        the end even if the client leaves: a registration is not undone by a closed socket."""
        task = asyncio.ensure_future(work)
        self.api.tasks.add(task)
        task.add_done_callback(functools.partial(self._worked_out, req))

    def _worked_out(self, req: Request, task: asyncio.Future[Answer]) -> None:
        self.api.tasks.discard(task)
        if task.cancelled():
            self.answer_error(req, ServiceUnavailable("the server is shutting down"))
            return
        error = task.exception()
        if error is None:
            self.answer(req, *task.result())
        elif isinstance(error, MserveError):
            self.answer_error(req, error)
        else:
            log.error("unexpected error on %s %s", req.method, req.target.decode("latin-1"),
                      exc_info=error)  # fmt: skip
            self.answer_error(req, InternalError("internal server error; see the server log"))

    def closing_after(self, ex: Request) -> bool:
        """Whether the connection ends after ``ex`` (the client's last, or we are stopping)."""
        return self.api.stopping or (self.closing and (not self.pending or ex is self.pending[-1]))

    def close_when_done(self) -> None:
        """Stop reading; close once the answers already owed are written."""
        self.closing = True
        if not self.pending and self.transport is not None:
            self.transport.close()

    def check_timeouts(self, now: float) -> None:
        """Close a connection idle past its timeout, or one trickling its headers in (a client
        sending a byte a minute would otherwise hold it for ever)."""
        if self.transport is None or self._linger is not None:  # lingering has bounds of its own
            return
        api = self.api
        if self._receiving and self._current is None and now - self._began > api.read_timeout_s:
            self.transport.close()
            return
        if self.pending:
            return
        idle = now - self.last_active
        if idle > (api.read_timeout_s if self._receiving else api.keepalive_s):
            self.transport.close()

    # internals -------------------------------------------------------------------------

    def _grow_head(self, n: int) -> bool:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES and not self.closing:
            self._reject(HeadTooLarge(
                f"request line and headers are larger than {MAX_HEAD_BYTES} bytes"
            ))  # fmt: skip
        return not self.closing

    def _reject(self, error: MserveError, ex: Request | None = None, linger: bool = True) -> None:
        """Answer a request we will not read to the end, after those before it, and close.

        With ``linger``, what the client still sends is read and dropped until its request ends
        (when the parser can still tell), it closes, or a bound of server/http/linger.py is
        reached; the answer goes out meanwhile, followed by our half-close (FIN), so a client
        that reads only once it has sent everything still gets it."""
        if self.closing:
            return
        if ex is None:
            ex = Request("-", b"".join(self._url) or b"-", "1.1", False)
        ex.keep_alive = False
        self.pending.append(ex)
        self.closing = True
        if linger and self.transport is not None:
            self._linger = Linger(self._stop_lingering)
            if self._read_paused:
                self.transport.resume_reading()
                self._read_paused = False
        self.answer_error(ex, error)

    def _drop(self, data: bytes) -> None:
        """Lingering after a refusal: count ``data`` against the bounds and drop it; the parser
        (while it still can) says when the refused request ends."""
        assert self._linger is not None
        if not self._linger.dropped(len(data)):
            self._stop_lingering(f"more than {LINGER_BYTES} bytes sent")
            return
        if self._parser_ok:
            try:
                self.parser.feed_data(data)  # callbacks drop the body: we are closing
            except (httptools.HttpParserError, httptools.HttpParserUpgrade):
                self._parser_ok = False  # the rest is dropped raw, until EOF or the bounds

    def _stop_lingering(self, cut: str = "") -> None:
        """Close now, or once the answers still owed are written. ``cut``: the bound reached,
        when the client was not done (it may then see a reset)."""
        linger = self._linger
        if linger is None:
            return
        self._linger = None
        linger.cancel()
        if cut:
            log.debug("stopped reading a refused request from %s after %d bytes: %s",
                      self.remote, linger.dropped_bytes, cut)  # fmt: skip
        if not self.pending and self.transport is not None:
            self.transport.close()

    def _flush(self) -> None:
        pending, transport = self.pending, self.transport
        while pending and pending[0].out is not None:
            if pending[0].stream is not None and not self._flush_stream(pending[0]):
                return  # a streamed answer under way holds the head until it ends
            ex = pending.popleft()
            self._write(ex.out)  # type: ignore[arg-type]
            self.last_active = time.monotonic()  # idle from the answer on, not from the request
            if self.api.access_log is not None:
                self.api.access_log.add_line(
                    self.remote, ex.method, ex.target.decode("latin-1"), ex.version, ex.status,
                    ex.length, time.perf_counter() - ex.started, ex.tag,
                    None if ex.tenant is None else ex.tenant.name,
                )  # fmt: skip
            if self.api.on_answer is not None:
                self.api.on_answer(ex.status)
            if not ex.keep_alive:
                self.closing = True
                for rest in pending:
                    if rest.future is not None and not rest.future.done():
                        rest.future.cancel()
                pending.clear()
                if transport is None:
                    return
                if self._linger is None:
                    transport.close()
                elif transport.can_write_eof():
                    transport.write_eof()  # the answer is complete; the client's rest is read
                return
        if self.closing and not pending and transport is not None and self._linger is None:
            transport.close()
            return
        self._update_reading()

    def _flush_stream(self, ex: Request) -> bool:
        """Write what the streamed answer at the head has so far; True once it has ended (it
        then leaves the head like any answer). One that broke closes the connection without
        the terminating chunk, which is how its client learns it is incomplete."""
        answer = ex.stream
        assert answer is not None and ex.out is not None
        out = ex.out
        if out:
            if len(out) > 1 and answer.buffered < LARGE_BODY:
                out = [b"".join(out)]  # many small chunks: one buffer beats a long writev
            self._write(out)
            ex.out = []
            answer.buffered = 0
        if answer.state == "open":
            if self._write_paused:
                answer.source.pause()
            return False
        ex.stream = None
        if answer.state == "ended":
            return True
        self.last_active = time.monotonic()
        if self.api.access_log is not None:
            self.api.access_log.add_line(
                self.remote, ex.method, ex.target.decode("latin-1"), ex.version, ex.status,
                ex.length, time.perf_counter() - ex.started, ex.tag,
                None if ex.tenant is None else ex.tenant.name,
            )  # fmt: skip
        if self.api.on_answer is not None:  # a broken stream is still one answer
            self.api.on_answer(ex.status)
        self.closing = True
        for rest in self.pending:
            if rest.future is not None and not rest.future.done():
                rest.future.cancel()
            elif rest.stream is not None:
                rest.stream.cancel()
        self.pending.clear()
        if self.transport is not None:
            self.transport.close()
        return False

    def _write(self, out: list[bytes | bytearray | memoryview]) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if len(out) == 1:
            self.transport.write(out[0])
        else:
            self.transport.writelines(out)

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        pause = self._write_paused or len(self.pending) >= MAX_IN_FLIGHT
        if pause and not self._read_paused:
            transport.pause_reading()
            self._read_paused = True
        elif not pause and self._read_paused:
            transport.resume_reading()
            self._read_paused = False
