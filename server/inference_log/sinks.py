"""Where inference-log records go: rotated JSON-lines files, or an HTTP CloudEvents receiver.

A sink's ``send`` takes one batch and returns the records it could not deliver (the logger
retries those with backoff, then counts them failed); it never raises for a receiver that is
down, slow or answering errors.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

from server.inference_log.post import Poster
from server.inference_log.records import Encoder, Record, event_time

log = logging.getLogger(__name__)


class FileSink:
    """JSON lines in ``path`` (one file per model version), rotated when it would pass
    ``max_bytes`` or is older than ``max_age_s``: ``<file>.1`` is the newest rotated one, at
    most ``keep`` are kept. Writes run in a thread so a slow disk never holds the event loop."""

    name = "file"

    def __init__(
        self, path: Path, encoder: Encoder, max_bytes: int, max_age_s: float, keep: int,
        requests: bool = True, responses: bool = True,
    ) -> None:  # fmt: skip
        self.path = path
        self.requests = requests
        self.responses = responses
        self.encoder = encoder
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.keep = keep
        self._started: float | None = None  # when the current file got its first line

    async def send(self, records: list[Record]) -> list[Record]:
        line = self.encoder.line
        text = "".join(line(r, self.requests, self.responses) + "\n" for r in records).encode()
        try:
            await asyncio.to_thread(self._write, text)
        except OSError as exc:
            log.warning("inference log: cannot write %s: %s", self.path, exc)
            return records
        return []

    def _write(self, data: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        now = time.time()
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = 0
        if self._started is None:
            self._started = now
        too_old = now - self._started >= self.max_age_s
        if size and (size + len(data) > self.max_bytes or too_old):
            self._rotate()
            self._started = now
        with open(self.path, "ab") as f:
            f.write(data)

    def _rotate(self) -> None:
        base = str(self.path)
        if self.keep <= 0:
            os.unlink(base)
            return
        oldest = f"{base}.{self.keep}"
        if os.path.exists(oldest):
            os.unlink(oldest)
        for i in range(self.keep - 1, 0, -1):
            if os.path.exists(f"{base}.{i}"):
                os.replace(f"{base}.{i}", f"{base}.{i + 1}")
        os.replace(base, f"{base}.1")

    async def close(self) -> None:
        return None


class CloudEventsSink:
    """POSTs each record's CloudEvents (binary content mode) to ``url``; a batch's events go
    out together, pipelined on kept-alive connections (server/inference_log/post.py)."""

    name = "cloudevents"

    def __init__(
        self, url: str, encoder: Encoder, requests: bool, responses: bool, timeout_s: float,
        connections: int,
    ) -> None:  # fmt: skip
        self.url = url
        self.encoder = encoder
        self.requests = requests
        self.responses = responses
        self._poster = Poster(url, timeout_s, connections)
        self.last_error = ""

    async def send(self, records: list[Record]) -> list[Record]:
        messages, owners = [], []
        now = event_time()  # made together: one time stamp
        for i, record in enumerate(records):
            for message in self.encoder.events(record, self.requests, self.responses, now):
                messages.append((message.head, message.body))
                owners.append(i)
        statuses, why = await self._poster.post_all(messages)
        undelivered = set()
        for owner, status in zip(owners, statuses, strict=True):
            if status is None or not 200 <= status < 300:
                undelivered.add(owner)
                if status is not None:
                    why = why or f"the receiver answered {status}"
        if undelivered:
            self.last_error = why
        return [r for i, r in enumerate(records) if i in undelivered]

    async def close(self) -> None:
        await self._poster.close()


Sink = Any  # FileSink | CloudEventsSink: ``name``, ``send(records)``, ``close()``
