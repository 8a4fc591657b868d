"""One HTTP/1.1 keep-alive connection per sender: a request written in one send, its answer
read with httptools (the parser mserve's HTTP server runs on).

Why not httpx (which the server has, and which the replay first used): on this project's 2-core
test VM its async client spent ~3.2 ms of CPU per request (the sync one ~1.8 ms, http.client
~0.4 ms), so a replay reached 0.07x of what wrk gets from the same server at the same
concurrency; the replay's figure is to keep up with the traffic it replays
(scripts/bench_replay.py). server/inference_log/post.py made the same choice for the same
reason. What this covers is what a replay needs: POST with a body, http and https, answers
with a length, chunked or ending with the connection; no redirects, proxies or HTTP/2.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

import httptools

# an answer above this is cut there (its comparison is then of the first bytes): a target that
# streams without end must not fill the replay's memory
MAX_ANSWER_BYTES = 64 * 1024 * 1024


class SendError(Exception):
    """No answer: ``kind`` is ``unreachable`` (cannot connect), ``timeout`` or ``protocol``
    (the connection broke off or the answer does not parse)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Reply:
    """An answer: status, content type and body; ``keep``: the connection stays open."""

    def __init__(self) -> None:
        self.status = 0
        self.content_type = ""
        self.body = bytearray()
        self.keep = True
        self.done = False
        self.parser = httptools.HttpResponseParser(self)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        # read here: once the message is complete the parser no longer says
        self.status = self.parser.get_status_code()
        self.keep = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if len(self.body) < MAX_ANSWER_BYTES:
            self.body += body[: MAX_ANSWER_BYTES - len(self.body)]

    def on_message_complete(self) -> None:
        self.done = True


class _Protocol(asyncio.Protocol):
    """The connection's bytes fed to the answer's parser as they come (no stream reader in
    between: its buffering and futures cost more CPU per request than the parsing)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reply: Reply | None = None
        self.waiter: asyncio.Future[Reply] | None = None
        self.read_any = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reply, waiter = self.reply, self.waiter
        if reply is None or waiter is None or waiter.done():
            return  # bytes nobody asked for: the next request's parser would choke on them
        self.read_any = True
        try:
            reply.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            waiter.set_exception(SendError("protocol", f"the answer does not parse: {exc}"))
            return
        if reply.done:
            waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            why = f": {exc}" if exc else ""
            error = SendError("protocol", f"the connection closed before the answer{why}")
            error.nothing_read = not self.read_any  # type: ignore[attr-defined]
            waiter.set_exception(error)


class Connection:
    """Requests to one origin, one at a time, on a connection kept open between them."""

    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.https else 80)
        self.authority = parts.netloc.rsplit("@", 1)[-1]
        self.timeout_s = timeout_s
        self._protocol: _Protocol | None = None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> Reply:
        """POST ``body`` to ``path``: the answer, or SendError. A kept connection that the
        server closed meanwhile is opened again once (the request had not reached it)."""
        head = [f"POST {path} HTTP/1.1\r\nHost: {self.authority}\r\n"]
        head += [f"{name}: {value}\r\n" for name, value in headers.items()]
        head.append(f"Content-Length: {len(body)}\r\n\r\n")
        data = "".join(head).encode("latin-1") + body
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        reused = self._protocol is not None and not self._protocol.closed
        try:
            return await self._once(data, deadline)
        except SendError as exc:
            if not reused or exc.kind != "protocol" or not getattr(exc, "nothing_read", False):
                raise
        return await self._once(data, deadline)  # the kept connection had been closed

    async def _once(self, data: bytes, deadline: float) -> Reply:
        loop = asyncio.get_running_loop()
        protocol = self._protocol
        if protocol is None or protocol.closed:
            try:
                context = ssl.create_default_context() if self.https else None
                _, protocol = await asyncio.wait_for(
                    loop.create_connection(_Protocol, self.host, self.port, ssl=context),
                    max(0.001, deadline - loop.time()),
                )
            except (OSError, asyncio.TimeoutError) as exc:
                why = "timed out" if isinstance(exc, asyncio.TimeoutError) else str(exc)
                raise SendError(
                    "unreachable", f"cannot connect to {self.authority}: {why}"
                ) from None
            self._protocol = protocol
        reply = Reply()
        waiter: asyncio.Future[Reply] = loop.create_future()
        protocol.reply, protocol.waiter, protocol.read_any = reply, waiter, False
        expire = loop.call_at(deadline, _expire, waiter, self.timeout_s)
        assert protocol.transport is not None
        protocol.transport.write(data)
        try:
            await waiter
        except SendError as exc:
            self.close()
            raise exc from None
        finally:
            expire.cancel()
            protocol.reply = protocol.waiter = None
        if not reply.keep:
            self.close()
        return reply

    def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        self._protocol = None


def _expire(waiter: asyncio.Future[Reply], timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(SendError("timeout", f"no answer in {timeout_s} s"))
