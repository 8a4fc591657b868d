"""Our HTTP/1.1 server, on all three ports: connections over httptools' parser, routing left to
each port's router (server/rest/inference.py, server/rest/management.py).

Why not aiohttp: on the inference path the server's whole job is to move a body to a worker and
an answer back, and aiohttp's request, response, router and middleware objects cost ~100-140 us
of CPU per request (a bare protocol over httptools: ~12-22 us, scripts/bench_server.py and
docs/server.md); importing aiohttp also cost ~0.25 s of every cold start. The parsing is
httptools' (llhttp, Node.js's parser: request line, headers, Content-Length and chunked framing,
the request smuggling cases); this module keeps what our APIs need: keep-alive, pipelined
requests answered in order, size limits, idle timeouts, write flow control, the access log, and
TorchServe's JSON error body for every refusal. A router answers at once
(:meth:`Connection.answer`) or from a callback or task later; nothing here makes a coroutine
per request.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import parse_qsl, unquote

import httptools

from server.accesslog import AccessLogFile
from server.auth import Guard
from server.errors import (
    BadRequest,
    InternalError,
    MethodNotAllowed,
    MserveError,
    PathNotFound,
    RequestTooLarge,
    ServiceUnavailable,
)
from server.rest.description import describe

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024  # request line plus headers; more is answered 431
MAX_IN_FLIGHT = 32  # requests of one connection being served; reading pauses beyond it
SWEEP_S = 5.0  # how often connections are checked against the timeouts, at most
LARGE_BODY = 64 * 1024  # bodies from here on are written next to the head, not copied into it
# After refusing a request (413, 400, 431) the connection stays open a little while the client
# finishes sending, and what it sends is read and dropped: closing a socket with unread input
# makes the kernel send RST, and a client still sending its body (Python's http.client, urllib,
# requests) then loses the answer it had not read yet. Bounded in bytes and in time; a body
# declared larger than LINGER_BYTES is not waited for.
LINGER_BYTES = 8 * 1024 * 1024
LINGER_S = 5.0

_REASONS = {s.value: s.phrase for s in HTTPStatus}
JSON = "application/json"
# The request headers this server reads itself, found once as they arrive (one lower() per
# header) instead of by a scan of every header per lookup: four lookups per request cost ~20
# lower() calls before.
_KNOWN_HEADERS = frozenset(
    ("authorization", "content-length", "content-type", "expect", "transfer-encoding",
     "url_path")
)  # fmt: skip
# (status, headers, body): what a router's task returns to be answered
Answer = tuple[int, list[list[str]], bytes]


def json_answer(status: int, payload: Any) -> Answer:
    return status, [["Content-Type", JSON]], json.dumps(payload).encode()


class Request:
    """One request on a connection and, once known, its encoded answer.

    ``parts`` are the path's segments, percent-decoded, without trailing empty ones (``/m/`` is
    ``/m``; an empty one inside, ``/a//b``, stays and routes nowhere); ``query`` its parameters
    (the first of repeated ones); ``future`` what cancels the work when the client leaves
    first."""

    __slots__ = (
        "_query",
        "body",
        "future",
        "headers",
        "keep_alive",
        "known",
        "length",
        "method",
        "out",
        "parts",
        "query_string",
        "started",
        "status",
        "stream",
        "target",
        "version",
    )  # fmt: skip

    def __init__(self, method: str, target: bytes, version: str, keep_alive: bool) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.keep_alive = keep_alive
        self.headers: list[list[str]] = []
        # the first value of each of _KNOWN_HEADERS the request has, by lower-case name
        self.known: dict[str, str] = {}
        self.body = b""
        self.started = time.perf_counter()
        self.future: asyncio.Future[Any] | None = None
        self.out: list[bytes | bytearray | memoryview] | None = None  # the encoded answer
        self.status = 0
        self.length = 0
        self.stream: ChunkedAnswer | None = None  # a streamed answer under way
        path, _, self.query_string = target.partition(b"?")
        segments = path.decode("utf-8", "replace").split("/")[1:]
        while len(segments) > 1 and not segments[-1]:  # trailing slashes: TorchServe ignores them
            segments.pop()
        self.parts = [unquote(p) if "%" in p else p for p in segments]
        self._query: dict[str, str] | None = None

    @property
    def query(self) -> dict[str, str]:
        if self._query is None:
            query: dict[str, str] = {}
            for key, value in parse_qsl(
                self.query_string.decode("utf-8", "replace"), keep_blank_values=True
            ):
                query.setdefault(key, value)  # the first of repeated ones, as TorchServe reads
            self._query = query
        return self._query

    def allow(self, *methods: str) -> str:
        """The method (HEAD counts as GET), or 405 naming the allowed ones."""
        method = "GET" if self.method == "HEAD" else self.method
        if method not in methods:
            raise MethodNotAllowed(
                f"method {self.method} is not allowed here; use {', '.join(methods)}", methods
            )
        return method

    def not_found(self) -> PathNotFound:
        return PathNotFound(f"no such path: {self.method} {self.target.decode('latin-1')}")

    def header(self, name: str) -> str | None:
        name = name.lower()
        if name in _KNOWN_HEADERS:
            return self.known.get(name)
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None


class Router(Protocol):
    # "inference" or "management": answers ``OPTIONS /`` and ``/api-description``; "" none
    api_name: str

    def route(self, conn: Connection, req: Request) -> None:
        """Answer ``req`` through ``conn``, now or later; raise MserveError to refuse it."""


class HttpServer:
    """One listener: its connections, limits, timeouts and router."""

    def __init__(
        self,
        router: Router,
        access_log: AccessLogFile | None,
        max_request_bytes: int,
        *,
        keepalive_s: float = 75.0,
        read_timeout_s: float = 60.0,
        max_connections: int = 4096,
        on_answer: Callable[[int], None] | None = None,
        guard: Guard | None = None,
        redact: Callable[[str], str] | None = None,
    ) -> None:
        """``keepalive_s``: an idle connection is closed after it. ``read_timeout_s``: a request
        that stops arriving for that long, or whose request line and headers are not complete
        that long after they began (a client trickling them in), is dropped.
        ``max_connections``: more are closed as soon as they open (file descriptors are finite).
        ``guard``: token authorization, checked before a request is routed (None: off).
        ``redact``: applied to every error message answered (server paths out, the log keeps
        them; server/redaction.py)."""
        self.router = router
        self.guard = guard
        self.access_log = access_log
        self.on_answer = on_answer  # called with each answer's status (metrics)
        self.redact = redact
        self.max_request_bytes = max_request_bytes
        self.keepalive_s = keepalive_s
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self._sweep_s = min(SWEEP_S, keepalive_s / 2, read_timeout_s / 2)
        self.tasks: set[asyncio.Future[Answer]] = set()  # answers being worked out
        self.refusals = 0
        self._refusal_logged = -60.0
        self.connections: set[Connection] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def listen(
        self, host: str, port: int, tls: ssl.SSLContext | None = None
    ) -> tuple[str, int]:
        """``tls``: serve HTTPS with it (server/tls.py), else plain HTTP."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self), host, port, reuse_address=True, ssl=tls,
            ssl_handshake_timeout=self.read_timeout_s if tls else None,
        )  # fmt: skip
        self._sweeper = loop.call_later(self._sweep_s, self._sweep)
        bound = self._server.sockets[0].getsockname()
        return bound[0], bound[1]

    def stop_accepting(self) -> None:
        """No new connections; requests on open ones get 503 and ``Connection: close``."""
        self.stopping = True
        if self._server is not None:
            self._server.close()

    def close(self) -> None:
        """Close every connection (their queued answers are written first)."""
        self.stop_accepting()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.connections):
            conn.close_when_done()

    async def wait_closed(self, timeout_s: float) -> None:
        """Give closing connections time to write what they owe (bounded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.connections and loop.time() < deadline:
            await asyncio.sleep(0.01)

    def _sweep(self) -> None:
        now = time.monotonic()
        for conn in list(self.connections):
            conn.check_timeouts(now)
        self._sweeper = asyncio.get_running_loop().call_later(self._sweep_s, self._sweep)

    def refused(self) -> None:
        """A connection over ``max_connections`` was closed; said once a minute at most."""
        self.refusals += 1
        now = time.monotonic()
        if now - self._refusal_logged > 60:
            log.warning(
                "%d connection(s) closed at once: %d open, the most one port keeps"
                " (max_connections)", self.refusals, len(self.connections),
            )  # fmt: skip
            self._refusal_logged = now
            self.refusals = 0

    def dispatch(self, conn: Connection, req: Request) -> None:
        try:
            if self.stopping:
                raise ServiceUnavailable("the server is shutting down")
            if self.guard is not None:
                self.guard.check(req.parts, req.method, req.known.get("authorization"))
                if "authorization" in req.known:
                    # the key is the server's secret: a handler never sees it (with keys off,
                    # the header is the client's own and travels to the handler as sent); the
                    # length test spares lower() on the other names, per request
                    req.headers = [
                        h for h in req.headers
                        if len(h[0]) != 13 or h[0].lower() != "authorization"
                    ]  # fmt: skip
            api = self.router.api_name
            if api and (req.parts == ["api-description"] or (
                    req.method == "OPTIONS" and req.parts == [""])):  # fmt: skip
                req.allow("GET", "OPTIONS")
                conn.answer_json(req, 200, describe(api))
                return
            if "" in req.parts:
                raise req.not_found()
            self.router.route(conn, req)
        except MserveError as exc:
            conn.answer_error(req, exc)
        except Exception:  # the API edge: log it, answer 500, keep serving
            log.exception("unexpected error on %s %s", req.method, req.target.decode("latin-1"))
            conn.answer_error(req, InternalError("internal server error; see the server log"))


class Connection(asyncio.Protocol):
    """One client connection: httptools parses, exchanges are answered strictly in order."""

    def __init__(self, api: HttpServer) -> None:
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
        self._lingering = False  # refused: reading and dropping the rest before closing
        self._linger_left = 0  # bytes still allowed in
        self._linger_timer: asyncio.TimerHandle | None = None
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
            if self._lingering:
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
        self._lingering = False
        if self._linger_timer is not None:
            self._linger_timer.cancel()
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
        if lower in _KNOWN_HEADERS and lower not in self._known:
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
        refusal = self._framing_refusal(ex)
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

    def _framing_refusal(self, ex: Request) -> MserveError | None:
        """What llhttp lets through but we refuse, since a proxy in front may frame it another
        way (request smuggling) or we would misread it: a version other than 1.0 and 1.1, a
        transfer coding other than plain ``chunked`` (``gzip, chunked`` would hand the handler
        compressed bytes), Transfer-Encoding in HTTP/1.0 (RFC 9112 6.1), and a protocol switch
        (llhttp stops at it, so a body would be lost). An Upgrade without a body is answered as
        HTTP/1.1, as RFC 9110 lets a server do, and the connection closes after it."""
        if ex.version not in ("1.0", "1.1"):
            return _VersionNotSupported(f"HTTP/{ex.version} is not supported; use HTTP/1.1")
        coding = ex.known.get("transfer-encoding")
        if coding is not None:
            if ex.version == "1.0":
                return BadRequest("Transfer-Encoding is not allowed in an HTTP/1.0 request")
            if coding.strip().lower() != "chunked":
                return _CodingNotImplemented(
                    f"Transfer-Encoding {coding!r} is not supported; only chunked is"
                )
        if self.parser.should_upgrade():
            length = ex.known.get("content-length")
            if ex.method == "CONNECT" or coding is not None or (length and length.strip("0")):
                return BadRequest(
                    "protocol upgrades (WebSocket, h2c) are not supported, nor CONNECT"
                )
            ex.keep_alive = False
        return None

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
        if self._lingering:  # the refused request's body has all arrived (and was dropped)
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
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in headers]
        lines.append(f"Content-Length: {len(body)}\r\nDate: {_http_date()}\r\nServer: mserve\r\n")
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
        if self.transport is None:
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
            self._reject(_HeadTooLarge(
                f"request line and headers are larger than {MAX_HEAD_BYTES} bytes"
            ))  # fmt: skip
        return not self.closing

    def _reject(self, error: MserveError, ex: Request | None = None, linger: bool = True) -> None:
        """Answer a request we will not read to the end, after those before it, and close.

        With ``linger``, what the client still sends is read and dropped until its request ends
        (when the parser can still tell), it half-closes, LINGER_BYTES have come or LINGER_S
        have passed; the answer goes out meanwhile, followed by our half-close (FIN), so a
        client that reads only once it has sent everything still gets it."""
        if self.closing:
            return
        if ex is None:
            ex = Request("-", b"".join(self._url) or b"-", "1.1", False)
        ex.keep_alive = False
        self.pending.append(ex)
        self.closing = True
        if linger and self.transport is not None:
            self._lingering = True
            self._linger_left = LINGER_BYTES
            self._linger_timer = asyncio.get_running_loop().call_later(
                LINGER_S, self._stop_lingering
            )
            if self._read_paused:
                self.transport.resume_reading()
                self._read_paused = False
        self.answer_error(ex, error)

    def _drop(self, data: bytes) -> None:
        """Lingering after a refusal: count ``data`` against the budget and drop it; the parser
        (while it still can) says when the refused request ends."""
        self._linger_left -= len(data)
        if self._linger_left < 0:
            self._stop_lingering()
            return
        if self._parser_ok:
            try:
                self.parser.feed_data(data)  # callbacks drop the body: we are closing
            except (httptools.HttpParserError, httptools.HttpParserUpgrade):
                self._parser_ok = False  # the rest is dropped raw, until EOF or the bounds

    def _stop_lingering(self) -> None:
        """Close now, or once the answers still owed are written."""
        if not self._lingering:
            return
        self._lingering = False
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
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
                    ex.length, time.perf_counter() - ex.started,
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
                if not self._lingering:
                    transport.close()
                elif transport.can_write_eof():
                    transport.write_eof()  # the answer is complete; the client's rest is read
                return
        if self.closing and not pending and transport is not None and not self._lingering:
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
                ex.length, time.perf_counter() - ex.started,
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


class StreamSource(Protocol):
    """Where a streamed answer's chunks come from (``server.streaming.ChunkStream``)."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def cancel(self) -> None: ...


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
        lines = [f"HTTP/1.1 {self.status} {_REASONS.get(self.status, 'Unknown')}\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in self.headers]
        lines.append(f"Transfer-Encoding: chunked\r\nDate: {_http_date()}\r\nServer: mserve\r\n")
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


class _HeadTooLarge(MserveError):
    status = 431
    type = "BadRequestException"  # TorchServe: its HTTP decoder fails, a 400


class _CodingNotImplemented(MserveError):
    status = 501  # RFC 9112 6.1: a transfer coding the server does not understand
    type = "BadRequestException"


class _VersionNotSupported(MserveError):
    status = 505
    type = "BadRequestException"


def error_body(parts: list[str], error: MserveError, message: str) -> dict[str, object]:
    """TorchServe's ``{code, type, message}``; on KServe's paths (``/v1/...``, ``/v2/...``) the
    Open Inference Protocol's ``{"error": message}``, which its clients read. ``message``: the
    error's, as it may be told to this client (server/redaction.py)."""
    if parts and parts[0] in ("v1", "v2"):
        return {"error": message}
    return {**error.body(), "message": message}


def header_ok(name: str, value: str) -> bool:
    """Whether a header can be written as it is: a name, no line breaks, and text the answer's
    encoding (UTF-8, surrogateescape for the bytes a client sent) can carry: a lone surrogate
    from a handler cannot be, and failing to encode it would leave the caller without answer."""
    if (
        not name or "\r" in name or "\n" in name or ":" in name or "\r" in value or "\n" in value
    ):  # fmt: skip
        return False
    if name.isascii() and value.isascii():
        return True
    try:
        name.encode("utf-8", "surrogateescape")
        value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


_date_second = -1
_date = ""


def _http_date() -> str:
    """RFC 9110 ``Date``, formatted once a second rather than once a response."""
    global _date_second, _date
    now = int(time.time())
    if now != _date_second:
        _date_second, _date = now, formatdate(now, usegmt=True)
    return _date
