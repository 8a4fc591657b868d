"""Where inference-log records go: rotated JSON-lines files, or an HTTP CloudEvents receiver.

A sink's ``send`` takes one batch and returns the records it could not deliver, and says in
``progress`` whether it delivered anything at all (the logger sends what is left again, with
backoff, until it is delivered or ``retries`` more tries delivered nothing, then counts it
failed); it never raises for a receiver that is down, slow or answering errors. ``send`` with
``retry`` is given exactly what the last one returned.
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
    progress = False  # the last send delivered something

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

    async def send(self, records: list[Record], retry: bool = False) -> list[Record]:
        line = self.encoder.line
        text = "".join(line(r, self.requests, self.responses) + "\n" for r in records).encode()
        self.progress = False
        try:
            await asyncio.to_thread(self._write, text)
        except OSError as exc:
            log.warning("inference log: cannot write %s: %s", self.path, exc)
            return records
        self.progress = True
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
    out together, pipelined on kept-alive connections (server/inference_log/post.py). Only the
    events that were not delivered are sent again, as they were made: a record whose request
    event arrived and whose response event failed gets its response event again, not both."""

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
        self.progress = False  # the last send delivered an event
        # the events the last send left undelivered, by record (the record kept for ``is``)
        self._left: dict[int, tuple[Record, list[tuple[str, bytes]]]] = {}

    async def send(self, records: list[Record], retry: bool = False) -> list[Record]:
        messages: list[tuple[str, bytes]] = []
        owners: list[Record] = []
        now = event_time()  # made together: one time stamp
        for record in records:
            kept = self._left.get(id(record))
            if kept is not None and kept[0] is record:
                events = kept[1]
            else:
                made = self.encoder.events(record, self.requests, self.responses, now)
                events = [(message.head, message.body) for message in made]
            messages.extend(events)
            owners.extend([record] * len(events))
        statuses, why = await self._poster.post_all(messages, retry)
        left: dict[int, tuple[Record, list[tuple[str, bytes]]]] = {}
        self.progress = False
        for owner, message, status in zip(owners, messages, statuses, strict=True):
            if status is not None and 200 <= status < 300:
                self.progress = True
                continue
            left.setdefault(id(owner), (owner, []))[1].append(message)
            if status is not None:
                why = why or f"the receiver answered {status}"
        self._left = left
        if left:
            self.last_error = why
        return [r for r in records if id(r) in left]

    async def close(self) -> None:
        await self._poster.close()


Sink = Any  # FileSink | CloudEventsSink: ``name``, ``send(records, retry)``, ``progress``,
# ``close()``
