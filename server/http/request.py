"""One request on a connection, as the parser hands it over: method, target, headers, body and,
once known, its encoded answer; and the limits a request is held to (the size of its head, the
framing we accept on top of llhttp's), each refused in TorchServe's error shape.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qsl, unquote

from server.errors import BadRequest, MethodNotAllowed, MserveError, PathNotFound

if TYPE_CHECKING:
    from server.tenants import Tenant

MAX_HEAD_BYTES = 64 * 1024  # request line plus headers; more is answered 431
# The request headers this server reads itself, found once as they arrive (one lower() per
# header) instead of by a scan of every header per lookup: four lookups per request cost ~20
# lower() calls before.
KNOWN_HEADERS = frozenset(
    ("authorization", "content-length", "content-type", "expect", "transfer-encoding",
     "url_path", "x-request-id", "traceparent", "tracestate")
)  # fmt: skip


class StreamSource(Protocol):
    """Where a streamed answer's chunks come from (``server.streaming.ChunkStream``)."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def cancel(self) -> None: ...


class OpenStream(Protocol):
    """A streamed answer under way (server/http/chunked.py's ChunkedAnswer), as the connection
    drives it: written as its client reads, cancelled when its client leaves."""

    source: StreamSource
    state: str  # "open", then "ended", "broken" or "gone"
    buffered: int  # bytes held in the request's ``out``, not written yet

    def cancel(self) -> None: ...


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
        "tag",
        "target",
        "tenant",
        "version",
    )  # fmt: skip

    def __init__(self, method: str, target: bytes, version: str, keep_alive: bool) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.keep_alive = keep_alive
        self.headers: list[list[str]] = []
        # the first value of each of KNOWN_HEADERS the request has, by lower-case name
        self.known: dict[str, str] = {}
        self.body = b""
        self.started = time.perf_counter()
        self.future: asyncio.Future[Any] | None = None
        self.out: list[bytes | bytearray | memoryview] | None = None  # the encoded answer
        self.status = 0
        self.length = 0
        self.stream: OpenStream | None = None  # a streamed answer under way
        # a prediction's facts for the access log: request id, trace id, model, version, worker
        self.tag: tuple[str, str, str, str, str] | None = None
        self.tenant: Tenant | None = None  # who sent it, while the server has tenants
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
        if name in KNOWN_HEADERS:
            return self.known.get(name)
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None


class HeadTooLarge(MserveError):
    status = 431
    type = "BadRequestException"  # TorchServe: its HTTP decoder fails, a 400


class _CodingNotImplemented(MserveError):
    status = 501  # RFC 9112 6.1: a transfer coding the server does not understand
    type = "BadRequestException"


class _VersionNotSupported(MserveError):
    status = 505
    type = "BadRequestException"


def framing_refusal(ex: Request, upgrade: bool) -> MserveError | None:
    """What llhttp lets through but we refuse, since a proxy in front may frame it another
    way (request smuggling) or we would misread it: a version other than 1.0 and 1.1, a
    transfer coding other than plain ``chunked`` (``gzip, chunked`` would hand the handler
    compressed bytes), Transfer-Encoding in HTTP/1.0 (RFC 9112 6.1), and a protocol switch
    (llhttp stops at it, so a body would be lost; ``upgrade``: the parser saw one). An Upgrade
    without a body is answered as HTTP/1.1, as RFC 9110 lets a server do, and the connection
    closes after it."""
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
    if upgrade:
        length = ex.known.get("content-length")
        if ex.method == "CONNECT" or coding is not None or (length and length.strip("0")):
            return BadRequest("protocol upgrades (WebSocket, h2c) are not supported, nor CONNECT")
        ex.keep_alive = False
    return None
