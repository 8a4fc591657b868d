"""The inference API (8080): TorchServe's and KServe v2's paths on our own HTTP/1.1 connections.

Why not aiohttp, as on the management port: on this path the server's whole job is to move a
body to a worker and an answer back, and aiohttp's request, response, router and middleware
objects cost ~100 us of CPU per request (scripts/bench_server.py; a bare aiohttp app answering
at once does ~100 us/request, a bare protocol over httptools ~15 us). At thousands of requests a
second on two cores that was most of the frontend's time. So the parsing is httptools' (llhttp,
Node.js's parser: request line, headers, Content-Length and chunked framing, the request
smuggling cases), and this module keeps only what the inference port needs: routing, keep-alive,
pipelined requests answered in order, size limits, idle timeouts, write flow control, the
access log. A prediction runs no coroutine: the parsed request goes on the model's queue and the
answer is written from the future's callback.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import json
import logging
import os
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl, unquote

import httptools

from server.accesslog import AccessLogFile
from server.app import Metrics, models_page
from server.errors import (
    BadRequest,
    InternalError,
    MethodNotAllowed,
    ModelNotFound,
    MserveError,
    RequestTooLarge,
    ResponseTooLarge,
    ServiceUnavailable,
)
from server.model import ModelVersion
from server.registry import Registry
from server.workers.protocol import RequestItem, ResponseItem

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024  # request line plus headers; more is answered 431
MAX_IN_FLIGHT = 32  # requests of one connection being served; reading pauses beyond it
KEEPALIVE_S = 75.0  # an idle keep-alive connection is closed after this (aiohttp's default)
READ_TIMEOUT_S = 60.0  # a request that started arriving but sends nothing for this long
SWEEP_S = 5.0  # how often connections are checked against the two timeouts
LARGE_BODY = 64 * 1024  # bodies from here on are written next to the head, not copied into it

_REASONS = {s.value: s.phrase for s in HTTPStatus}
# Set by the server alone: a handler's value would break the framing or contradict ours.
_SERVER_HEADERS = frozenset(
    ("content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "date",
     "server", "content-type", "x-request-id")
)  # fmt: skip
_JSON = "application/json"


class _Exchange:
    """One request on a connection and, once known, its encoded answer."""

    __slots__ = (
        "body",
        "future",
        "headers",
        "keep_alive",
        "length",
        "method",
        "out",
        "started",
        "status",
        "target",
        "version",
    )  # fmt: skip

    def __init__(self, method: str, target: bytes, version: str, keep_alive: bool) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.keep_alive = keep_alive
        self.headers: list[list[str]] = []
        self.body = b""
        self.started = time.perf_counter()
        self.future: asyncio.Future[ResponseItem] | None = None
        self.out: list[bytes | bytearray | memoryview] | None = None  # the encoded answer
        self.status = 0
        self.length = 0

    def header(self, name: str) -> str | None:
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None


class InferenceAPI:
    """The listener, its connections and the routes of the inference port."""

    def __init__(
        self,
        registry: Registry,
        metrics: Metrics,
        access_log: AccessLogFile | None,
        max_request_bytes: int,
        max_response_bytes: int,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.access_log = access_log
        self.max_request_bytes = max_request_bytes
        self.max_response_bytes = max_response_bytes
        self.connections: set[Connection] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self), host, port, reuse_address=True
        )
        self._sweeper = loop.call_later(SWEEP_S, self._sweep)
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
        self._sweeper = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)

    # --- routes -------------------------------------------------------------------------

    def route(self, conn: Connection, ex: _Exchange) -> None:
        """Answer ``ex`` (now for the simple routes, later for predictions)."""
        path, _, query = ex.target.partition(b"?")
        parts = [unquote(p) for p in path.decode("utf-8", "replace").split("/")[1:]]
        try:
            if self.stopping:
                raise ServiceUnavailable("the server is shutting down")
            if "" in parts:
                raise ModelNotFound(f"no such path: {ex.method} {path.decode('latin-1')}")
            self._route(conn, ex, parts, query)
        except MserveError as exc:
            conn.answer_error(ex, exc)
        except Exception:  # the API edge: log it, answer 500, keep serving
            log.exception("unexpected error on %s %s", ex.method, ex.target.decode("latin-1"))
            conn.answer_error(ex, InternalError("internal server error; see the server log"))

    def _route(self, conn: Connection, ex: _Exchange, parts: list[str], query: bytes) -> None:
        method = "GET" if ex.method == "HEAD" else ex.method
        n = len(parts)
        head = parts[0] if parts else ""
        if head in ("predictions", "explanations") and n in (2, 3):
            _allow(method, "POST", "PUT")
            version = parts[2] if n == 3 else None
            if head == "predictions":
                self._infer(conn, ex, parts[1], version, "", query)
            else:  # TorchServe adds this header too; handlers written for it look at it
                ex.headers.append(["explain", "True"])
                self._infer(conn, ex, parts[1], version, "explain", query)
            return
        if parts == ["ping"]:
            _allow(method, "GET")
            healthy = all(mv.healthy() for mv in self.registry.all())
            status = {"status": "Healthy" if healthy else "Unhealthy"}
            conn.answer_json(ex, 200 if healthy else 500, status)
            return
        if parts == ["models"]:
            _allow(method, "GET")
            conn.answer_json(ex, 200, models_page(self.registry, _query(query)))
            return
        if head == "v2":
            self._v2(conn, ex, method, parts[1:], query)
            return
        raise ModelNotFound(f"no such path: {ex.method} {ex.target.decode('latin-1')}")

    def _v2(
        self, conn: Connection, ex: _Exchange, method: str, parts: list[str], query: bytes
    ) -> None:
        """KServe v2: health, model metadata and readiness, infer/explain/custom operations."""
        if len(parts) == 2 and parts[0] == "health" and parts[1] in ("live", "ready"):
            _allow(method, "GET")
            if parts[1] == "live":
                conn.answer_json(ex, 200, {"live": True})
            else:
                ready = all(mv.healthy() for mv in self.registry.all())
                conn.answer_json(ex, 200 if ready else 503, {"ready": ready})
            return
        if len(parts) < 2 or parts[0] != "models":
            raise ModelNotFound(f"no such path: {ex.method} {ex.target.decode('latin-1')}")
        name, rest, version = parts[1], parts[2:], None
        if len(rest) >= 2 and rest[0] == "versions":
            version, rest = rest[1], rest[2:]
        if not rest:
            _allow(method, "GET")
            model = self.registry.get(name, version)
            versions = [mv.version for mv in self.registry.versions(name)]
            metadata = {"name": model.name, "versions": versions, "platform": "mserve",
                        "inputs": [], "outputs": []}  # fmt: skip
            conn.answer_json(ex, 200, metadata)
            return
        if len(rest) != 1:
            raise ModelNotFound(f"no such path: {ex.method} {ex.target.decode('latin-1')}")
        op = rest[0]
        if op == "ready" and method == "GET":
            model = self.registry.get(name, version)
            ready = model.failed is None and model.ready_workers() > 0
            body = {"name": model.name, "version": model.version, "ready": ready}
            conn.answer_json(ex, 200 if ready else 503, body)
            return
        _allow(method, "POST")
        if op in ("infer", "predict"):
            op = ""
        elif op == "explain":
            ex.headers.append(["explain", "True"])
        elif not op.isidentifier():
            raise BadRequest(f"operation {op!r} is not a valid name (letters, digits and '_')")
        self._infer(conn, ex, name, version, op, query)

    def _infer(
        self, conn: Connection, ex: _Exchange, name: str, version: str | None, op: str,
        query: bytes,
    ) -> None:  # fmt: skip
        model = self.registry.get(name, version)
        item = RequestItem(
            request_id=_request_id(),
            content_type=ex.header("Content-Type") or "",
            headers=ex.headers,
            body=ex.body,
            params=_query(query) if query else {},
            op=op,
        )
        try:
            ex.future = model.enqueue(item)
        except MserveError as exc:
            self.metrics.answered(model.name, model.version, exc.status, None)
            raise
        ex.future.add_done_callback(
            functools.partial(self._answered, conn, ex, model, item.request_id)
        )

    def _answered(
        self, conn: Connection, ex: _Exchange, model: ModelVersion, request_id: str,
        future: asyncio.Future[ResponseItem],
    ) -> None:  # fmt: skip
        if future.cancelled():  # the client went away
            return
        error = future.exception()
        if error is not None:
            if not isinstance(error, MserveError):
                log.error("unexpected error answering %s", model.label, exc_info=error)
                error = InternalError("internal server error; see the server log")
            self.metrics.answered(model.name, model.version, error.status, None)
            conn.answer_error(ex, error)
            return
        result = future.result()
        if len(result.body) > self.max_response_bytes:
            self.metrics.answered(model.name, model.version, 413, None)
            conn.answer_error(ex, ResponseTooLarge(
                f"the response of {model.label} is {len(result.body)} bytes, more than"
                f" max_response_size_bytes={self.max_response_bytes}"
            ))  # fmt: skip
            return
        content_type = result.content_type or "application/octet-stream"
        headers = [[k, v] for k, v in result.headers if k.lower() not in _SERVER_HEADERS]
        headers += [["Content-Type", content_type], ["X-Request-Id", request_id]]
        bad = next((k for k, v in headers if not _header_ok(k, v)), None)
        if bad is not None:
            self.metrics.answered(model.name, model.version, 500, None)
            conn.answer_error(ex, InternalError(
                f"the handler of {model.label} set response header {bad!r} to a value that"
                " is not a valid HTTP header (control characters or an empty name)"
            ))  # fmt: skip
            return
        self.metrics.answered(
            model.name, model.version, result.status, time.perf_counter() - ex.started
        )
        conn.answer(ex, result.status, headers, result.body)


class Connection(asyncio.Protocol):
    """One client connection: httptools parses, exchanges are answered strictly in order."""

    def __init__(self, api: InferenceAPI) -> None:
        self.api = api
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.remote = "-"
        self.pending: collections.deque[_Exchange] = collections.deque()
        self.last_active = time.monotonic()
        self.closing = False  # no more requests are read; close once pending ones are written
        self._current: _Exchange | None = None  # the request being received, once its head is
        self._receiving = False  # a request has begun arriving
        self._url: list[bytes] = []
        self._headers: list[list[str]] = []
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._read_paused = False
        self._write_paused = False

    # asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.remote = str(peer[0])
        self.api.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.last_active = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(BadRequest("protocol upgrades are not supported on the inference API"))
        except httptools.HttpParserError as exc:
            if not self.closing:  # not one of our own rejections from a callback
                self._reject(BadRequest(f"malformed HTTP request: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.api.connections.discard(self)
        for ex in self.pending:  # queued requests of a gone client cost no worker time
            if ex.future is not None and not ex.future.done():
                ex.future.cancel()
        self.pending.clear()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    # httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._receiving = True
        self._url = []
        self._headers = []
        self._head_bytes = 0
        self._body = []
        self._body_bytes = 0
        self._current = None

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        self._grow_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._grow_head(len(name) + len(value) + 4):
            self._headers.append(
                [name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")]
            )

    def on_headers_complete(self) -> None:
        if self.closing:
            return
        parser = self.parser
        ex = self._current = _Exchange(
            parser.get_method().decode("ascii", "replace"),
            b"".join(self._url),
            parser.get_http_version(),
            parser.should_keep_alive(),
        )
        ex.headers = self._headers
        length = ex.header("Content-Length")
        limit = self.api.max_request_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            self._reject(RequestTooLarge(
                f"request body is {length} bytes, more than max_request_size_bytes={limit}"
            ), ex)  # fmt: skip
            return
        if (ex.header("Expect") or "").lower() == "100-continue" and not self.pending:
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
        if self.closing or ex is None:
            return
        ex.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        self.pending.append(ex)
        if not ex.keep_alive:
            self.closing = True  # the client's last request
        self.api.route(self, ex)
        self._update_reading()

    # answers ---------------------------------------------------------------------------

    def answer(
        self, ex: _Exchange, status: int, headers: list[list[str]],
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

    def answer_json(self, ex: _Exchange, status: int, payload: Any) -> None:
        body = json.dumps(payload).encode()
        self.answer(ex, status, [["Content-Type", _JSON]], body)

    def answer_error(self, ex: _Exchange, error: MserveError) -> None:
        headers = [["Content-Type", _JSON], *([k, v] for k, v in error.headers().items())]
        self.answer(ex, error.status, headers, json.dumps(error.body()).encode())

    def closing_after(self, ex: _Exchange) -> bool:
        """Whether the connection ends after ``ex`` (the client's last, or we are stopping)."""
        return self.api.stopping or (self.closing and (not self.pending or ex is self.pending[-1]))

    def close_when_done(self) -> None:
        """Stop reading; close once the answers already owed are written."""
        self.closing = True
        if not self.pending and self.transport is not None:
            self.transport.close()

    def check_timeouts(self, now: float) -> None:
        idle = now - self.last_active
        if self.pending or self.transport is None:
            return
        if idle > (READ_TIMEOUT_S if self._receiving else KEEPALIVE_S):
            self.transport.close()

    # internals -------------------------------------------------------------------------

    def _grow_head(self, n: int) -> bool:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES and not self.closing:
            self._reject(_HeadTooLarge(
                f"request line and headers are larger than {MAX_HEAD_BYTES} bytes"
            ))  # fmt: skip
        return not self.closing

    def _reject(self, error: MserveError, ex: _Exchange | None = None) -> None:
        """Answer a request we will not read to the end, after those before it, and close."""
        if self.closing:
            return
        if ex is None:
            ex = _Exchange("-", b"".join(self._url) or b"-", "1.1", False)
        ex.keep_alive = False
        self.pending.append(ex)
        self.closing = True
        self.answer_error(ex, error)

    def _flush(self) -> None:
        pending, transport = self.pending, self.transport
        while pending and pending[0].out is not None:
            ex = pending.popleft()
            self._write(ex.out)  # type: ignore[arg-type]
            if self.api.access_log is not None:
                self.api.access_log.add_line(
                    self.remote, ex.method, ex.target.decode("latin-1"), ex.version, ex.status,
                    ex.length, time.perf_counter() - ex.started,
                )  # fmt: skip
            if not ex.keep_alive:
                self.closing = True
                for rest in pending:
                    if rest.future is not None and not rest.future.done():
                        rest.future.cancel()
                pending.clear()
                if transport is not None:
                    transport.close()
                return
        if self.closing and not pending and transport is not None:
            transport.close()
            return
        self._update_reading()

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


class _HeadTooLarge(MserveError):
    status = 431


def _allow(method: str, *allowed: str) -> None:
    if method not in allowed:
        raise MethodNotAllowed(f"method {method} is not allowed here; use {', '.join(allowed)}",
                               allowed)  # fmt: skip


def _query(query: bytes) -> dict[str, str]:
    return dict(parse_qsl(query.decode("utf-8", "replace"), keep_blank_values=True))


def _header_ok(name: str, value: str) -> bool:
    return bool(name) and not any(c in name for c in "\r\n:") and "\r" not in value and (
        "\n" not in value
    )


_id_prefix = os.urandom(8).hex()
_id_counter = itertools.count()


def _request_id() -> str:
    """32 hex digits, unique like uuid4's: random per server process, then a counter (one
    ``os.urandom`` per request was a getrandom() system call each)."""
    return f"{_id_prefix}{next(_id_counter):016x}"


_date_second = -1
_date = ""


def _http_date() -> str:
    """RFC 9110 ``Date``, formatted once a second rather than once a response."""
    global _date_second, _date
    now = int(time.time())
    if now != _date_second:
        _date_second, _date = now, formatdate(now, usegmt=True)
    return _date
