"""One listener (a port): accepting connections, its limits and timeouts, the guard and the
router a request goes to; and, in uvicorn's order, how it stops: stop accepting, let open
connections write what they owe (against a deadline), close.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from typing import Protocol

from server.accesslog import AccessLogFile
from server.auth import Guard
from server.errors import InternalError, MserveError, ServiceUnavailable
from server.http.answer import Answer
from server.http.connection import Connection
from server.http.request import Request

log = logging.getLogger(__name__)

SWEEP_S = 5.0  # how often connections are checked against the timeouts, at most


class Router(Protocol):
    """A port's API: what its paths mean is the router's alone (server/rest/,
    server/metrics/server_metrics.py), the API description included; this layer only connects,
    guards and answers."""

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
                req.tenant = self.guard.check(req.parts, req.method, req.known.get("authorization"))
                if "authorization" in req.known:
                    # the key is the server's secret: a handler never sees it (with keys off,
                    # the header is the client's own and travels to the handler as sent); the
                    # length test spares lower() on the other names, per request
                    req.headers = [
                        h for h in req.headers
                        if len(h[0]) != 13 or h[0].lower() != "authorization"
                    ]  # fmt: skip
            if "" in req.parts and len(req.parts) > 1:  # an empty segment; "/" is the root
                raise req.not_found()
            self.router.route(conn, req)
        except MserveError as exc:
            conn.answer_error(req, exc)
        except Exception:  # the API edge: log it, answer 500, keep serving
            log.exception("unexpected error on %s %s", req.method, req.target.decode("latin-1"))
            conn.answer_error(req, InternalError("internal server error; see the server log"))
