"""Lingering close, as nginx does it: after refusing a request (413, 400, 431) the connection
is not closed at once, since closing a socket with unread input makes the kernel send RST, and
a client still sending its body (Python's ``http.client``, ``urllib``, ``requests`` send it all
before they read) would lose the answer waiting in its receive buffer. So what the client still
sends is read and dropped, for as long as it keeps coming, within bounds; then the connection
closes. Nothing of it is kept.

The bounds, whichever comes first:

- ``LINGER_IDLE_S`` (2 s) without a byte: the client has stopped sending (or finished and
  waits for our close). A client uploading a body sends without pauses that long.
- ``LINGER_S`` (10 s) in all: enough for 64 MiB on a 100 Mbit/s link (~5.5 s); a client still
  sending after it is cut off, so a slow sender cannot hold a connection for ever (each
  lingering connection still counts against ``max_connections``).
- ``LINGER_BYTES`` (1 GiB) dropped: about what a 1 Gbit/s link carries in ``LINGER_S``. On
  faster links (loopback, a data centre's network) the time bound alone would let one client
  make the server read and drop tens of gigabytes; the bytes cost nothing to hold, only to
  read. A body declared (``Content-Length``) larger than this is not waited for at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

LINGER_BYTES = 1024 * 1024 * 1024
LINGER_S = 10.0
LINGER_IDLE_S = 2.0


class Linger:
    """The bounds of one connection's lingering close; ``on_end(why)`` is called once, when a
    time bound is reached (the byte bound is the caller's to act on: :meth:`dropped`)."""

    __slots__ = ("_deadline", "_last", "_left", "_loop", "_on_end", "_timer", "dropped_bytes")

    def __init__(self, on_end: Callable[[str], None]) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._on_end = on_end
        self._left = LINGER_BYTES
        now = loop.time()
        self._last = now
        self._deadline = now + LINGER_S
        self.dropped_bytes = 0
        self._timer: asyncio.TimerHandle | None = loop.call_at(now + LINGER_IDLE_S, self._tick)

    def dropped(self, n: int) -> bool:
        """Count ``n`` more bytes read and dropped; False once more than LINGER_BYTES have
        been."""
        self.dropped_bytes += n
        self._last = self._loop.time()
        return self.dropped_bytes <= LINGER_BYTES

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        now = self._loop.time()
        idle_end = self._last + LINGER_IDLE_S
        if now >= self._deadline:
            self._timer = None
            self._on_end(f"still sending after {LINGER_S:g} s")
        elif now >= idle_end:
            self._timer = None
            self._on_end(f"nothing sent for {LINGER_IDLE_S:g} s")
        else:
            self._timer = self._loop.call_at(min(self._deadline, idle_end), self._tick)
