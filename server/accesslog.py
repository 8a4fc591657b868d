"""access.log: one line per request, in mserve's layout or TorchServe's (server/linefile.py
buffers the lines)."""

from __future__ import annotations

from pathlib import Path

from server.linefile import ISO_SECONDS, LineFile


class AccessLogFile(LineFile):
    def __init__(self, path: Path, max_lines: int = 512, torchserve: bool = False) -> None:
        """``torchserve``: TorchServe's access_log.log line, ``<time> - /client "POST /p
        HTTP/1.1" 200 12`` (the last number: milliseconds)."""
        super().__init__(path, max_lines, ISO_SECONDS if torchserve else "%Y-%m-%d %H:%M:%S")
        self._torchserve = torchserve

    def add_line(
        self, remote: str, method: str, target: str, version: str, status: int, length: int,
        elapsed_s: float,
    ) -> None:  # fmt: skip
        if self._torchserve:
            self.append(
                f"{self.stamp()} - /{remote} "
                f'"{method} {target} HTTP/{version}" {status} {int(elapsed_s * 1000)}\n'
            )
        else:
            self.append(
                f"{self.stamp()} {remote} "
                f'"{method} {target} HTTP/{version}" {status} {length} {elapsed_s:.6f}\n'
            )
