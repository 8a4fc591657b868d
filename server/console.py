"""The server's console: log lines on a terminal or pipe that the server does not own.

In the TorchServe layout the server writes its log to the stdout of whoever started it, as
TorchServe does (launchers and tests read it, and wait for ``Model server started.``). That
stdout may be a pipe nobody reads any more: a write there would block, and a blocked write on
the event loop's thread would stop the server. So lines go through a bounded queue to a thread
of their own; when the queue is full (the reader is stuck), lines are dropped and counted, and
the log files still get every line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time

QUEUE_LINES = 10_000


class ConsoleHandler(logging.Handler):
    """A logging handler that never blocks its caller (see the module docstring)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self.lines: queue.Queue[str | None] = queue.Queue(QUEUE_LINES)
        self.dropped = 0
        self._writer = threading.Thread(target=self._write, name="console", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.put(self.format(record))
        except Exception:  # a record that cannot be formatted: logging's own report
            self.handleError(record)

    def put(self, line: str) -> None:
        try:
            self.lines.put_nowait(line)
        except queue.Full:
            self.dropped += 1

    def say(self, line: str, wait_s: float = 2.0) -> None:
        """Write ``line`` after every line before it, and wait (up to ``wait_s``) until it is
        written: ``Model server started.`` must be on the console before the start returns."""
        self.put(line)
        deadline = time.monotonic() + wait_s
        while self.lines.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def _write(self) -> None:
        while True:
            line = self.lines.get()
            try:
                if line is None:
                    return
                if self.dropped:
                    note = f"[console: {self.dropped} log lines dropped: the reader is behind]\n"
                    self.dropped = 0
                    self._send(note)
                self._send(line + "\n")
            finally:
                self.lines.task_done()

    def _send(self, text: str) -> None:
        data = text.encode("utf-8", "replace")
        try:
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError:  # the terminal or pipe is gone: the log files have the lines
            pass

    def close(self) -> None:
        """Write what is queued (up to a second), then stop the writer."""
        with contextlib.suppress(queue.Full):
            self.lines.put(None, timeout=1.0)
        self._writer.join(1.0)
        super().close()
