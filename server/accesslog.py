"""access.log: one line per request, kept in memory and written in one go.

Formatting through the logging module (a LogRecord, a format pass and a write per request), as
aiohttp's access logger did, cost ~10% of the frontend's CPU under load (cProfile). Here a line is
one f-string appended to a list, and the list goes to the file when it holds ``max_lines``,
every ``flush_s`` (the server's flusher task) and at stop. Rotate the file with logrotate
(``copytruncate``): we append, and never stat it per line.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import IO


class AccessLogFile:
    def __init__(self, path: Path, max_lines: int = 512, torchserve: bool = False) -> None:
        """``torchserve``: TorchServe's access_log.log line, ``<time> - /client "POST /p
        HTTP/1.1" 200 12`` (the last number: milliseconds)."""
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 (owned, closed)
        self._lines: list[str] = []
        self._max_lines = max_lines
        self._stamp_second = -1
        self._stamp = ""
        self._torchserve = torchserve

    def add_line(
        self, remote: str, method: str, target: str, version: str, status: int, length: int,
        elapsed_s: float,
    ) -> None:  # fmt: skip
        now = time.time()
        second = int(now)
        if second != self._stamp_second:  # strftime once a second, not once a request
            self._stamp_second = second
            form = "%Y-%m-%dT%H:%M:%S" if self._torchserve else "%Y-%m-%d %H:%M:%S"
            self._stamp = time.strftime(form, time.localtime(second))
        if self._torchserve:
            self._lines.append(
                f"{self._stamp},{int((now - second) * 1000):03d} - /{remote} "
                f'"{method} {target} HTTP/{version}" {status} {int(elapsed_s * 1000)}\n'
            )
        else:
            self._lines.append(
                f"{self._stamp},{int((now - second) * 1000):03d} {remote} "
                f'"{method} {target} HTTP/{version}" {status} {length} {elapsed_s:.6f}\n'
            )
        if len(self._lines) >= self._max_lines:
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
