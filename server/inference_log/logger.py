"""The per-model inference logger: the batch pump hands it each settled batch; it samples,
makes records and appends them to one bounded queue per sink. A task per sink takes batches
from its queue and sends them with retries and backoff, so a request never waits for a sink:
a full queue drops the record and counts it (``mserve_inference_log_records_total``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mserve_worker.protocol import RequestItem, ResponseItem
from server.errors import MserveError
from server.inference_log.policy import LogPolicy, safe_url
from server.inference_log.records import Record
from server.inference_log.sinks import Sink

if TYPE_CHECKING:
    from server.streaming import ChunkStream
    from server.tenants import Tenant

log = logging.getLogger(__name__)

OUTCOMES = ("sent", "dropped", "failed")
# Connections to a CloudEvents receiver, each carrying its share of a batch pipelined: on
# loopback each write costs the sender the receiver's TCP work too (1 connection: 63 us of the
# frontend's CPU per record, 4: 76 us, 32: 169 us, measured with a batch of 32)
RECEIVER_CONNECTIONS = 2


@dataclass(frozen=True)
class Delivery:
    """How every sink of the server delivers (the server config's ``inference_log_*``)."""

    queue_size: int = 10_000  # records waiting per sink of a model version
    flush_s: float = 1.0  # a batch that is not full goes out this long after its first record
    retries: int = 3  # more tries that deliver nothing, after 0.2 s, 0.4 s, 0.8 s ... (a try
    # that delivers some of what it sent does not count; what it left goes again after 0.2 s)
    backoff_s: float = 0.2
    backoff_max_s: float = 5.0
    max_stream_bytes: int = 6_553_500  # of a streamed answer, what a record keeps (build():
    # the server's max_response_size_bytes)


class _Queue:
    """One sink's waiting records and the task that sends them."""

    def __init__(self, sink: Sink, counts: dict[str, Any]) -> None:
        self.sink = sink
        self.records: collections.deque[Record] = collections.deque()
        self.first_at = 0.0  # when the oldest waiting record arrived
        self.wake = asyncio.Event()
        self.counts = counts  # outcome -> the counter child (or None without metrics)
        self.task: asyncio.Task[None] | None = None
        self.failing = False  # said once per outage in the log


class InferenceLogger:
    """Samples a model version's settled requests into records for its sinks."""

    def __init__(
        self, label: str, policy: LogPolicy, sinks: Sequence[Sink], delivery: Delivery,
        counter: Any = None, model: str = "", version: str = "",
    ) -> None:  # fmt: skip
        self.label = label
        self.policy = policy
        self.delivery = delivery
        self._seen = 0
        self._closing = False
        self._queues = []
        for sink in sinks:
            counts = {
                o: counter.labels(model, version, sink.name, o) if counter is not None else None
                for o in OUTCOMES
            }
            self._queues.append(_Queue(sink, counts))
        self.totals: dict[tuple[str, str], int] = collections.Counter()

    def start(self) -> None:
        """Start the sink tasks (on the running loop); :meth:`close` ends them."""
        for queue in self._queues:
            if queue.task is None:
                queue.task = asyncio.ensure_future(self._deliver(queue))

    # --- the request path -------------------------------------------------------------------

    def settled(
        self, items: Sequence[RequestItem], results: Sequence[ResponseItem],
        enqueued_at: Sequence[float], logged: Any = None,
        tenants: Sequence[Tenant | None] = (),
    ) -> None:  # fmt: skip
        """A batch was answered; ``logged``: the worker's ``[request id, record]`` pairs (v2
        model classes' logged_results, a RESULT frame's ``inference_log``); ``tenants``: who
        sent each request, while the server has tenants (server/tenants/)."""
        by_id = _by_id(logged) if logged else None
        for i, (item, result) in enumerate(zip(items, results, strict=False)):
            if self._sampled():
                error = None
                if result.status >= 400 and "json" in (result.content_type or ""):
                    error = _error_message(result.body)
                extra = by_id.get(item.request_id) if by_id is not None else None
                self._offer(item, result.status, result.content_type, result.body, error,
                            enqueued_at[i], extra if isinstance(extra, dict) else None,
                            result.json_body, _name(tenants, i))  # fmt: skip

    def stream(
        self, item: RequestItem, enqueued_at: float, stream: ChunkStream,
        tenant: Tenant | None = None,
    ) -> None:  # fmt: skip
        """A request's answer started streaming: when it is sampled, its record is made once
        the stream ends, with the answer's chunks joined (its first ``max_stream_bytes``; none
        kept when only requests are logged), a broken stream's error, and 499 for a client
        that went away."""
        if not self._sampled():
            return

        def ended(stream: ChunkStream, body: bytes, error: MserveError | None) -> None:
            if stream.cancelled:
                status, message = 499, "the client went away before the answer ended"
            elif error is not None:
                status, message = error.status, error.message
            else:
                status, message = stream.status, None
            self._offer(item, status, stream.content_type, body, message, enqueued_at, None,
                        tenant=None if tenant is None else tenant.name)  # fmt: skip

        stream.record_to(self.delivery.max_stream_bytes if self.policy.responses else 0, ended)

    def failed(
        self, items: Sequence[RequestItem], enqueued_at: Sequence[float], status: int,
        message: str, tenants: Sequence[Tenant | None] = (),
    ) -> None:  # fmt: skip
        """A batch failed as a whole (the handler raised, the worker died or timed out)."""
        for i, (item, at) in enumerate(zip(items, enqueued_at, strict=False)):
            if self._sampled():
                self._offer(item, status, "", b"", message, at, None, tenant=_name(tenants, i))

    def _sampled(self) -> bool:
        self._seen += 1
        return self._seen % self.policy.sample == 0

    def _offer(
        self, item: RequestItem, status: int, response_type: str, response_body: Any,
        error: str | None, enqueued_at: float, logged: dict[str, Any] | None,
        response_json: bool = False, tenant: str | None = None,
    ) -> None:  # fmt: skip
        now = time.monotonic()
        record = Record(
            item.request_id, _event_id(item), item.api, item.op,
            time.time() - (now - enqueued_at), int((now - enqueued_at) * 1e6),
            item.content_type, bytes(item.body), status, response_type, bytes(response_body),
            error, logged, response_json, tenant,
        )  # fmt: skip
        self._append(record, now)

    def event(self, op: str, message: str, detail: dict[str, Any]) -> None:
        """A model-level event, not a request (a canary rolled back or promoted, server/
        rollouts/): always logged, as a record of api ``event`` whose request is ``detail`` (JSON)
        and whose error is ``message``."""
        now = time.monotonic()
        body = json.dumps(detail, sort_keys=True).encode()
        event_id = f"{op}-{time.time_ns():x}"
        record = Record(event_id, event_id, "event", op, time.time(), 0, "application/json",
                        body, 200, "", b"", message, None)  # fmt: skip
        self._append(record, now)

    def _append(self, record: Record, now: float) -> None:
        limit = self.delivery.queue_size
        for queue in self._queues:
            records = queue.records
            if len(records) >= limit or self._closing:
                self._count(queue, "dropped", 1)
                continue
            records.append(record)
            if len(records) == 1:
                queue.first_at = now
                queue.wake.set()
            elif len(records) >= self.policy.batch:
                queue.wake.set()

    # --- the sink tasks ---------------------------------------------------------------------

    async def _deliver(self, queue: _Queue) -> None:
        while True:
            batch = await self._next_batch(queue)
            if batch is None:
                return
            await self._send(queue, batch)

    async def _next_batch(self, queue: _Queue) -> list[Record] | None:
        """The next batch: ``batch`` records, or fewer once the oldest waited ``flush_s`` or
        the logger closes; None when closed and empty."""
        records, size = queue.records, self.policy.batch
        while True:
            now = time.monotonic()
            timeout = None
            if records:
                timeout = queue.first_at + self.delivery.flush_s - now
                if len(records) >= size or self._closing or timeout <= 0:
                    batch = [records.popleft() for _ in range(min(size, len(records)))]
                    queue.first_at = now  # what is left waits from here
                    return batch
            elif self._closing:
                return None
            queue.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(queue.wake.wait(), timeout)

    async def _send(self, queue: _Queue, batch: list[Record]) -> None:
        """Sends ``batch``, then what a try left, again and on its own (``retry``), until all
        is delivered or ``retries`` more tries delivered nothing at all. A try that delivered
        some of it does not count against them: a receiver that fails some requests (a round
        robin with a broken backend: every 3rd POST answered 500) still gets every record,
        whatever position it lands in; only one that delivers nothing makes records fail. The
        tries stay bounded: one that does not count delivered an event, so a batch gets at
        most ``retries + 1`` tries more than it has events, each within the sink's timeout."""
        sink, delivery = queue.sink, self.delivery
        pending = batch
        tries = failures = 0  # tries made, tries that delivered nothing
        while True:
            try:
                left = await sink.send(pending, retry=tries > 0)
                progress = bool(sink.progress)
            except Exception:  # the task's guard: a sink bug must not end logging
                log.exception("inference log of %s: sink %s failed", self.label, sink.name)
                left, progress = pending, False
            tries += 1
            self._count(queue, "sent", len(pending) - len(left))
            pending = left
            if not pending:
                if queue.failing:
                    log.info("inference log of %s: %s delivers again", self.label, sink.name)
                    queue.failing = False
                return
            if not progress:
                failures += 1
                if failures > delivery.retries:
                    break
            # the backoff grows with the tries that delivered nothing; after one that
            # delivered something, what it left goes again after the first step
            delay = delivery.backoff_s * (1 if progress else 2 ** (failures - 1))
            await asyncio.sleep(min(delay, delivery.backoff_max_s))
        self._count(queue, "failed", len(pending))
        if not queue.failing:
            queue.failing = True
            where = safe_url(getattr(sink, "url", "")) or str(getattr(sink, "path", ""))
            why = getattr(sink, "last_error", "") or "write failed"
            log.warning(
                "inference log of %s: %d record(s) not delivered to %s %s after %d tries (%s);"
                " requests are still answered", self.label, len(pending), sink.name, where,
                tries, why,
            )  # fmt: skip

    def _count(self, queue: _Queue, outcome: str, n: int) -> None:
        if n <= 0:
            return
        self.totals[(queue.sink.name, outcome)] += n
        child = queue.counts[outcome]
        if child is not None:
            child.inc(n)

    async def close(self, deadline_s: float = 5.0) -> None:
        """Send what is queued (within ``deadline_s``), then stop the tasks and sinks."""
        self._closing = True
        tasks = [q.task for q in self._queues if q.task is not None]
        for queue in self._queues:
            queue.wake.set()
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=deadline_s)
            for task in pending:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*pending, return_exceptions=True)
        for queue in self._queues:
            dropped = len(queue.records)
            queue.records.clear()
            self._count(queue, "dropped", dropped)
            await queue.sink.close()


def _by_id(logged: Any) -> dict[Any, Any]:
    """A RESULT's ``inference_log`` pairs by request id; malformed ones ignored."""
    if not isinstance(logged, list):
        return {}
    return {p[0]: p[1] for p in logged if isinstance(p, list) and len(p) == 2}


def _name(tenants: Sequence[Tenant | None], i: int) -> str | None:
    """The name of the i-th request's tenant (None: no tenants, or none given)."""
    tenant = tenants[i] if i < len(tenants) else None
    return None if tenant is None else tenant.name


def _event_id(item: RequestItem) -> str:
    """KServe's id: the request's ``ce-id`` header, else ours (the answer's X-Request-Id)."""
    for name, value in item.headers:
        if len(name) == 5 and name.lower() == "ce-id" and value:
            return value
    return item.request_id


def _error_message(body: Any) -> str | None:
    """The message of an error answer in TorchServe's or OIP's JSON shape."""
    try:
        parsed = json.loads(bytes(body))
    except ValueError:
        return None
    if isinstance(parsed, dict):
        message = parsed.get("message", parsed.get("error"))
        return message if isinstance(message, str) else None
    return None


def build(
    name: str, version: str, settings: Any, config: Any, counter: Any = None
) -> InferenceLogger | None:
    """The logger of a model version from its settings and the server config; None when its
    logging is off. Raises InvalidModel for a bad setting."""
    from server.config import split_address
    from server.inference_log.policy import parse_policy
    from server.inference_log.records import Encoder
    from server.inference_log.sinks import CloudEventsSink, FileSink

    label = f"{name}:{version}"
    policy = parse_policy(label, settings)
    if policy is None:
        return None
    source = config.inference_log_source
    if not source:  # KServe's default: http://localhost:<the port it serves>/
        port = split_address(config.inference_address, "inference_address")[2]
        source = f"http://localhost:{port}/" if port else "http://localhost/"
    encoder = Encoder(name, version, policy.redact, source, config.inference_log_namespace)
    sinks: list[Sink] = []
    if policy.file:
        path = config.run_path / "inference_log" / name / f"{version}.jsonl"
        sinks.append(FileSink(path, encoder, config.inference_log_file_max_bytes,
                              config.inference_log_file_max_age_s,
                              config.inference_log_file_count, policy.requests,
                              policy.responses))  # fmt: skip
    if policy.url:
        sinks.append(CloudEventsSink(policy.url, encoder, policy.requests, policy.responses,
                                     config.inference_log_timeout_s,
                                     RECEIVER_CONNECTIONS))  # fmt: skip
    delivery = Delivery(
        queue_size=config.inference_log_queue_size,
        flush_s=config.inference_log_flush_s,
        retries=config.inference_log_retries,
        max_stream_bytes=config.max_response_size_bytes,
    )
    where = ", ".join(
        s.name + (f" {safe_url(policy.url)}" if s.name == "cloudevents" and policy.url else "")
        for s in sinks
    )
    log.info(
        "model %s: inference log on (%s, every %d request(s), batches of %d) to %s",
        label, policy.mode, policy.sample, policy.batch, where,
    )  # fmt: skip
    return InferenceLogger(label, policy, sinks, delivery, counter, name, version)
