"""Sending recorded requests to a target, as recorded (scaled) or as fast as a bounded number
of requests in flight allows, and comparing each answer with the recorded one as it comes.

One kept-alive connection per request in flight (client.py); a bounded queue between the
reader and the senders, so a log of millions of records is never held in memory.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from server.compare import Answer, CompareOptions, compare
from server.replay.client import Connection, SendError
from server.replay.records import Recorded, Skipped
from server.replay.report import Summary
from server.replay.target import Target

# this many connection failures in a row, with no answer at all, and the target is down:
# the replay stops there rather than failing every record one by one
_DOWN_AFTER = 20


@dataclass(frozen=True)
class Selection:
    """Which records are replayed: one model (the first record's when None), a time window
    (seconds since the epoch), a random share (``seed`` makes it repeatable) and a count."""

    model: str | None = None
    since: float | None = None
    until: float | None = None
    sample: float = 1.0
    seed: int = 0
    limit: int | None = None


@dataclass(frozen=True)
class Pace:
    """``speed``: the recorded pace times this (2 is twice as fast); None: as fast as
    ``concurrency`` requests in flight allow."""

    concurrency: int = 8
    speed: float | None = None
    timeout_s: float = 30.0


def select(
    records: Iterable[Recorded], selection: Selection, skipped: Skipped
) -> Iterator[Recorded]:
    """The records to replay; the others counted in ``skipped`` by reason."""
    rng = random.Random(selection.seed)
    model = selection.model
    taken = 0
    for record in records:
        if model is None:
            model = record.model
        if record.model != model:
            skipped.add("other_model", record.where, f"model {record.model!r}, not {model!r}")
        elif not _inside(record.when, selection):
            skipped.counts["outside_window"] += 1
        elif record.response is None:
            skipped.add("no_recorded_answer", record.where, "a request event without its answer")
        elif selection.sample < 1.0 and rng.random() >= selection.sample:
            skipped.counts["not_sampled"] += 1
        elif selection.limit is not None and taken >= selection.limit:
            skipped.counts["over_limit"] += 1
        else:
            taken += 1
            yield record


def _path(url: str) -> str:
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def _inside(when: float, selection: Selection) -> bool:
    if selection.since is not None and when < selection.since:
        return False
    return selection.until is None or when <= selection.until


async def replay(
    records: Iterable[Recorded],
    target: Target,
    headers: dict[str, str],
    pace: Pace,
    options: CompareOptions,
    summary: Summary,
    progress: Callable[[], None] = lambda: None,
) -> None:
    """Replay ``records`` against ``target``, adding each outcome to ``summary``."""
    queue: asyncio.Queue[Recorded | None] = asyncio.Queue(maxsize=pace.concurrency * 2)
    down = asyncio.Event()
    failures_in_a_row = [0]

    async def send(connection: Connection, record: Recorded) -> None:
        request_headers = dict(headers)
        if record.request_type:
            request_headers.setdefault("Content-Type", record.request_type)
        url = target.endpoint(record)
        started = time.perf_counter()
        try:
            reply = await connection.post(_path(url), target.body(record), request_headers)
        except SendError as exc:
            summary.failed(record, exc.kind, str(exc))
            if exc.kind == "unreachable":
                failures_in_a_row[0] += 1
                if failures_in_a_row[0] >= _DOWN_AFTER and summary.replayed == 0:
                    down.set()
            return
        latency_s = time.perf_counter() - started
        failures_in_a_row[0] = 0
        candidate = Answer(reply.status, bytes(reply.body), reply.content_type)
        reference = Answer(record.status, record.response or b"", record.response_type)
        summary.add(record, candidate, latency_s, compare(reference, candidate, options))

    async def worker() -> None:
        connection = Connection(target.url, pace.timeout_s)
        try:
            while True:
                record = await queue.get()
                if record is None:
                    return
                if not down.is_set():
                    await send(connection, record)
                else:
                    summary.failed(record, "unreachable", "the target is down: not sent")
                progress()
        finally:
            connection.close()

    workers = [asyncio.create_task(worker()) for _ in range(pace.concurrency)]
    try:
        started = time.monotonic()
        first_when: float | None = None
        summary.started()
        for record in records:
            if down.is_set():
                summary.failed(record, "unreachable", "the target is down: not sent")
                progress()
                continue
            if pace.speed is not None and record.when:
                first_when = record.when if first_when is None else first_when
                due = started + (record.when - first_when) / pace.speed
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            await queue.put(record)
        for _ in workers:
            await queue.put(None)
        await asyncio.gather(*workers)
        summary.finished()
    finally:
        for task in workers:
            task.cancel()
