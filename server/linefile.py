"""An append-only log file whose lines wait in memory and reach the file in one write.

The access log and TorchServe's metric logs take a line per request or per metric update:
formatting through the logging module (a LogRecord, a format pass and a write each) took a large
share of the frontend's CPU under load (docs/explanations/costs.md). Here a line is a string
appended to a list; the list goes to the file when it holds ``max_lines``, every second (the
server's flusher task) and at stop. Rotate such a file with logrotate (``copytruncate``): we
append, and never stat it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import IO

ISO_SECONDS = "%Y-%m-%dT%H:%M:%S"  # TorchServe's log4j stamp, before ``,<milliseconds>``


class LineFile:
    def __init__(
        self, path: Path, max_lines: int | None = None, time_format: str = ISO_SECONDS
    ) -> None:
        """``max_lines``: write as soon as that many wait (None: only when flushed)."""
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 (owned, closed)
        self._lines: list[str] = []
        self._max_lines = max_lines
        self._time_format = time_format
        self._stamp_second = -1
        self._stamp = ""

    def stamp(self) -> str:
        """Now as ``<time_format>,<milliseconds>``: strftime once a second, not once a line."""
        now = time.time()
        second = int(now)
        if second != self._stamp_second:
            self._stamp_second = second
            self._stamp = time.strftime(self._time_format, time.localtime(second))
        return f"{self._stamp},{int((now - second) * 1000):03d}"

    def append(self, line: str) -> None:
        """``line`` ends with its own newline."""
        self._lines.append(line)
        if self._max_lines is not None and len(self._lines) >= self._max_lines:
            self.flush()

    def flush(self) -> None:
        if self._lines:
            self._file.write("".join(self._lines))
            self._lines.clear()
            self._file.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()

    async def flush_every(self, interval_s: float) -> None:
        """The server's flusher task: a line never waits longer than ``interval_s``."""
        while True:
            await asyncio.sleep(interval_s)
            self.flush()
