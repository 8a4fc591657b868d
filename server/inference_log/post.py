"""HTTP/1.1 POSTs of a batch of CloudEvents to one receiver, pipelined on kept-alive
connections.

Why not httpx (which the server has): its client spent ~200 us of the frontend's CPU per event
(measured with ``bench_server.py --inference-log``: echo at half its throughput with every
request logged), and the sender shares the frontend's event loop with the requests. Here a
batch's requests go out in one write per connection and their answers are read back with
httptools (the parser our HTTP server runs on): a few microseconds per event. Every receiver
that speaks HTTP/1.1 answers pipelined requests in order (RFC 9112, 9.3.2); one that closes
the connection early fails only the events it did not answer, and those are retried.
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
    """httptools callbacks: the status of each answer, in order."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.parser = httptools.HttpResponseParser(self)
        self.close = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"connection" and value.lower() == b"close":
            self.close = True

    def on_message_complete(self) -> None:
        self.statuses.append(self.parser.get_status_code())


class Poster:
    """POSTs to ``url`` over at most ``connections`` kept-alive connections."""

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
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self.tls else None

    async def post_all(self, messages: Sequence[tuple[str, bytes]]) -> tuple[list[int | None], str]:
        """Each message's answer status (None: not answered), and why the first one failed.
        A message: its header lines (each ending in CRLF; Host and Content-Length are added)
        and its body."""
        share = -(-len(messages) // self.connections) if messages else 1
        chunks = [messages[i : i + share] for i in range(0, len(messages), share)]
        results = await asyncio.gather(*(self._send(c) for c in chunks), return_exceptions=True)
        statuses: list[int | None] = []
        error = ""
        for chunk, result in zip(chunks, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, (PostError, OSError, asyncio.TimeoutError)):
                    raise result
                error = error or _why(result)
                statuses.extend([None] * len(chunk))
            else:
                got, why = result
                error = error or why
                statuses.extend(got + [None] * (len(chunk) - len(got)))
        return statuses, error

    async def _send(
        self, chunk: Sequence[tuple[str, bytes]], fresh: bool = False
    ) -> tuple[list[int], str]:
        reused = bool(self._idle) and not fresh
        reader, writer = self._idle.pop() if reused else await self._open()
        answers = _Answers()
        done = False
        try:
            start = self._start
            writer.write(b"".join([
                b"%s%d\r\n%s\r\n%s" % (start, len(body), head.encode("latin-1"), body)
                for head, body in chunk
            ]))  # fmt: skip
            await asyncio.wait_for(self._read(reader, answers, len(chunk)), self.timeout_s)
            done = not answers.close
        except asyncio.TimeoutError:
            raise PostError(f"no answer within {self.timeout_s:g} s") from None
        finally:
            if done:
                self._idle.append((reader, writer))
            else:
                writer.close()
        if reused and not answers.statuses:  # the receiver had closed it while idle
            return await self._send(chunk, fresh=True)
        why = "" if len(answers.statuses) == len(chunk) else "the receiver closed the connection"
        return answers.statuses, why

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self._ssl), self.timeout_s
            )
        except asyncio.TimeoutError:
            raise PostError(f"no connection within {self.timeout_s:g} s") from None

    async def _read(self, reader: asyncio.StreamReader, answers: _Answers, count: int) -> None:
        while len(answers.statuses) < count and not answers.close:
            data = await reader.read(65536)
            if not data:
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
