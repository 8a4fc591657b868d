"""HTTP/1.1 POSTs of a batch of CloudEvents to one receiver, pipelined on kept-alive
connections once a connection has shown that it persists.

Why not httpx (which the server has): its client spent ~200 us of the frontend's CPU per event
(measured with ``bench_server.py --inference-log``: echo at half its throughput with every
request logged), and the sender shares the frontend's event loop with the requests. Here a
batch's requests go out in one write per connection and their answers are read back with
httptools (the parser our HTTP server runs on): a few microseconds per event. Every receiver
that speaks HTTP/1.1 answers pipelined requests in order (RFC 9112, 9.3.2).

Pipelining waits until a connection is known to persist (RFC 2616, 8.1.2.2; RFC 9112, 9.3.2
keeps it for retries): a new connection carries one request, and the rest of its share follow,
pipelined, only once its answer kept it open. Requests pipelined behind the first on a
connection that closes after one answer are lost, and closing with them unread resets the
connection, which can lose the first answer as well (RFC 9112, 9.6, the TCP reset problem): a
receiver on Python's ``http.server`` as it ships (HTTP/1.0) got 12 of the 80 events of 40
logged requests, and no response event (issue 40). A receiver whose connections close after
their first answer (an HTTP/1.0 answer, ``Connection: close``, or a close without a word) gets
one request per connection from then on; the poster remembers it, so later batches do not spend
their tries finding out. A receiver that closes a connection after many answers (nginx's
``keepalive_requests``) keeps being pipelined to; what that connection left goes on a new one.
A retry sends one request at a time on one connection: only the events that failed, each on its
own, not pipelined again behind the same neighbours.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Sequence
from urllib.parse import urlsplit

import httptools


class PostError(Exception):
    """The receiver cannot be reached, broke off or timed out (the message says which)."""


class _Answers:
    """httptools callbacks: the status of each final answer, in order, and whether the
    connection stays open after the last one."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.parser = httptools.HttpResponseParser(self)
        self.status: int | None = None  # of the answer being read (its headers are in)
        self.keep = True  # the last answer leaves the connection open (HTTP/1.1, no close)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep = self.parser.should_keep_alive()

    def on_message_complete(self) -> None:
        if self.status is not None and self.status >= 200:  # not an interim 1xx
            self.statuses.append(self.status)
        self.status = None

    def closed(self) -> None:
        """The receiver closed the connection: an answer whose body runs to the close (an
        HTTP/1.0 one without Content-Length) ends with it (RFC 9112, 6.3)."""
        if self.status is not None and self.status >= 200:
            self.statuses.append(self.status)
        self.status = None
        self.keep = False

    def reading(self, count: int) -> bool:
        """Whether more of ``count`` answers can come on this connection."""
        return len(self.statuses) < count and (self.keep or self.status is not None)


_Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Poster:
    """POSTs to ``url`` over at most ``connections`` connections at a time, kept alive where
    the receiver keeps them."""

    def __init__(self, url: str, timeout_s: float, connections: int) -> None:
        parts = urlsplit(url)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (443 if self.tls else 80)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = self.host if ":" not in self.host else f"[{self.host}]"
        self.authority = host if parts.port is None else f"{host}:{parts.port}"
        self.timeout_s = timeout_s
        self.connections = max(1, connections)
        # learnt from its answers: the receiver closes a connection after its first answer
        self.one_per_connection = False
        self._idle: list[_Connection] = []  # each answered and was left open
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self.tls else None

    async def post_all(
        self, messages: Sequence[tuple[str, bytes]], retry: bool = False
    ) -> tuple[list[int | None], str]:
        """Each message's answer status (None: not answered), and why the first unanswered
        one was not. A message: its header lines (each ending in CRLF; Host and
        Content-Length are added) and its body. ``retry``: they failed before, and go one at
        a time on one connection; else each connection takes its share, pipelined where it
        persists. A try takes at most ``timeout_s`` per connection."""
        lanes = 1 if retry else self.connections
        share = -(-len(messages) // lanes) if messages else 1
        chunks = [messages[i : i + share] for i in range(0, len(messages), share)]
        answered: list[list[int]] = [[] for _ in chunks]
        results = await asyncio.gather(
            *(self._lane(c, got, retry) for c, got in zip(chunks, answered, strict=True)),
            return_exceptions=True,
        )
        statuses: list[int | None] = []
        error = ""
        for chunk, got, result in zip(chunks, answered, results, strict=True):
            if isinstance(result, BaseException):
                raise result  # a bug: the receiver's failures are answered as a reason
            error = error or result
            statuses.extend([*got, *[None] * (len(chunk) - len(got))])
        return statuses, error

    async def _lane(
        self, messages: Sequence[tuple[str, bytes]], statuses: list[int], retry: bool
    ) -> str:
        """Sends ``messages`` in order, one connection at a time, appending each answer's
        status to ``statuses``; why it stopped before the last ('' when it did not)."""
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        conn: _Connection | None = None
        pooled = False  # the connection in hand came from the idle ones
        answered = 0  # answers the connection in hand gave in this lane
        first = 0  # the status of its first answer, when it is new
        keep = False
        try:
            while len(statuses) < len(messages):
                if conn is None:
                    conn, pooled, answered = self._take_idle(), True, 0
                    if conn is None:
                        conn, pooled = await self._open(deadline), False
                rest = messages[len(statuses) :]
                persists = pooled or answered > 0  # answered and stayed open
                pipeline = persists and not retry and not self.one_per_connection
                answers = await self._exchange(conn, rest if pipeline else rest[:1], deadline)
                statuses.extend(answers.statuses)
                got = len(answers.statuses)
                keep = answers.keep and not self.one_per_connection
                if got == 0:
                    conn[1].close()
                    conn = None
                    if not (pooled or answered):
                        return "the receiver closed the connection"
                    # closed after its answers without a word, or while it waited idle
                    self._closed(pooled, answered, first)
                    continue
                if not (pooled or answered):
                    first = answers.statuses[0]
                answered += got
                if not keep:  # HTTP/1.0, Connection: close, or closed after the answers
                    self._closed(pooled, answered, first)
                    conn[1].close()
                    conn = None
            return ""
        except (PostError, OSError, asyncio.TimeoutError) as exc:
            keep = False
            return _why(exc)
        finally:
            if conn is not None:
                if keep:
                    self._idle.append(conn)
                else:
                    conn[1].close()

    def _closed(self, pooled: bool, answered: int, first: int) -> None:
        """A connection closed: when it was new and closed after its first answer, a success
        (a receiver may close after an error only), every connection of this receiver will."""
        if not pooled and answered == 1 and 200 <= first < 300:
            self.one_per_connection = True

    def _take_idle(self) -> _Connection | None:
        """A kept connection the receiver has not closed meanwhile, if there is one."""
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return None

    async def _exchange(
        self, conn: _Connection, chunk: Sequence[tuple[str, bytes]], deadline: float
    ) -> _Answers:
        """Writes ``chunk`` (pipelined when it has more than one) and reads its answers until
        all are in, the connection closes, or ``deadline``."""
        reader, writer = conn
        answers = _Answers()
        start = self._start
        writer.write(b"".join([
            b"%s%d\r\n%s\r\n%s" % (start, len(body), head.encode("latin-1"), body)
            for head, body in chunk
        ]))  # fmt: skip
        left_s = deadline - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(self._read(reader, answers, len(chunk)), max(left_s, 0))
        except asyncio.TimeoutError:
            raise PostError(f"no answer within {self.timeout_s:g} s") from None
        return answers

    async def _open(self, deadline: float) -> _Connection:
        left_s = deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self._ssl), max(left_s, 0)
            )
        except asyncio.TimeoutError:
            raise PostError(f"no connection within {self.timeout_s:g} s") from None

    async def _read(self, reader: asyncio.StreamReader, answers: _Answers, count: int) -> None:
        while answers.reading(count):
            try:
                data = await reader.read(65536)
            except ConnectionError:  # reset: the answers read before it stand
                data = b""
            if not data:
                answers.closed()
                return
            try:
                answers.parser.feed_data(data)
            except httptools.HttpParserError as exc:
                raise PostError(f"the receiver's answer is not HTTP: {exc}") from None

    @functools.cached_property
    def _start(self) -> bytes:
        """Every request's first lines, up to its Content-Length value."""
        return f"POST {self.path} HTTP/1.1\r\nHost: {self.authority}\r\nContent-Length: ".encode()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for _reader, writer in idle:
            writer.close()


def _why(exc: BaseException) -> str:
    if isinstance(exc, PostError):
        return str(exc)
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
