"""Reading a worker's (or a template's) output pipe with one owner for its file descriptor.

``loop.connect_read_pipe`` with a file object gives uvloop two owners of one descriptor: libuv
closes it in ``uv_close`` and the file object closes the same number again, at once or when
the garbage collector tears the transport down (uvloop keeps a pipe open after EOF when its
protocol asks, as ``StreamReaderProtocol`` does, so that teardown is the usual one). Between the
two closes another thread may be handed that number (the warm tier maps files in threads), and
the second close takes its descriptor away: a fork from a worker template failed with ``EBADF``
that way, then the worker started instead with ``exec`` saw its channel gone (MagicStack/uvloop
issue 763). Here the server reads the pipe itself, through ``add_reader``, and closes the
descriptor exactly once: at end of file, or when nothing reads it any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

READ_BYTES = 65536


class PipeReader:
    """Feeds ``reader`` from the pipe ``fd``, which it owns from now on; it stops reading while
    the reader holds more than twice its limit (``StreamReader`` pauses its transport), so a
    worker that prints faster than the server logs waits on its full pipe."""

    def __init__(self, fd: int, reader: asyncio.StreamReader) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = fd
        self._reader = reader
        self._watching = False
        os.set_blocking(fd, False)
        reader.set_transport(self)  # type: ignore[arg-type]  # pause/resume is all it uses
        self.resume_reading()

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def pause_reading(self) -> None:
        if self._watching:
            self._loop.remove_reader(self._fd)
            self._watching = False

    def resume_reading(self) -> None:
        if not self._watching and self._fd >= 0:
            self._loop.add_reader(self._fd, self._readable)
            self._watching = True

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the pipe broke: as good as its end
            data = b""
        if data:
            self._reader.feed_data(data)
            return
        self.close()
        self._reader.feed_eof()

    def close(self) -> None:
        """Stop reading and close the descriptor (once; later calls do nothing)."""
        if self._fd < 0:
            return
        self.pause_reading()
        fd, self._fd = self._fd, -1
        os.close(fd)

    def __del__(self) -> None:
        # abandoned while paused (nothing reads it, so the loop holds no reference): its only
        # owner closes it. Never while the loop watches it: the loop's callback refers to it.
        if self._fd >= 0 and not self._watching:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


def read_pipe(fd: int) -> asyncio.StreamReader:
    """A stream of what arrives on the pipe ``fd``; the descriptor is the reader's from now on
    (the caller never closes it)."""
    reader = asyncio.StreamReader()
    PipeReader(fd, reader)
    return reader
