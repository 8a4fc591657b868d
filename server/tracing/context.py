"""The frontend's side of tracing: a request's server span while it runs (:class:`RequestTrace`,
only ids and times), spans around server work, sampling, and the sink the finished records go
to (server/tracing/process.py's ExportProcess); and the ids of a request the access log names
whether or not the server traces. The frontend never imports the SDK here but for a client's
``tracestate``."""

from __future__ import annotations

import contextlib
import contextvars
import re
import time
from collections.abc import Iterator, Mapping
from random import getrandbits
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from server.tracing.settings import TraceSettings

# W3C trace context: version 00, 32 hex trace id, 16 hex parent id, 2 hex flags
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
# X-Request-ID: what we take from a client, else we make our own (server/rest/inference.py)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
CLIENT_GONE = 499  # a request whose client left first (nginx's code), as its span ends


def client_request_id(value: str | None) -> str | None:
    """The client's X-Request-ID when it is usable as ours: 1 to 128 characters of letters,
    digits and ``._:@/+=-`` (anything else could break a log line or a header); else None,
    and the server makes one."""
    if value is not None and _REQUEST_ID.match(value):
        return value
    return None


def trace_id_of(traceparent: str | None) -> str:
    """The trace id of a W3C ``traceparent`` ("" when there is none or it is malformed): the
    access log names it whether or not this server traces."""
    if traceparent is None or len(traceparent) != 55 or not _TRACEPARENT.match(traceparent):
        return ""
    return traceparent[3:35]


class Sink(Protocol):
    """Where span records go: server/tracing/process.py's ExportProcess."""

    dropped: dict[str, int]

    def put(self, record: tuple[Any, ...]) -> None: ...

    def start(self) -> None: ...

    async def close(self) -> None: ...


class QueuedJob(Protocol):
    """What a request's span is made of at its end: its job on a model's queue
    (server/models/batching.py's Job), times monotonic."""

    @property
    def enqueued_at(self) -> float: ...

    @property
    def sent_at(self) -> float:  # its batch sent to a worker; 0: never
        ...

    @property
    def sent(self) -> tuple[Any, Any] | None:  # (worker, batch): its id; jobs, future
        ...

    @property
    def handled(self) -> dict[str, Any] | None:  # a continuous-batching step's meta
        ...


class Tracing:
    """The server's tracing while it is on: sampling, the clock conversions, and the sink the
    span records go to."""

    def __init__(self, settings: TraceSettings, sink: Sink) -> None:
        self.settings = settings
        self.sink = sink
        # new traces whose id's low 64 bits fall under this are sampled (TraceIdRatioBased's rule)
        self.bound = round(settings.sampling_ratio * (1 << 64))
        # perf_counter and monotonic seconds to the epoch's nanoseconds, for spans made later
        now = time.time_ns()
        self._perf_ns = now - int(time.perf_counter() * 1e9)
        self._mono_ns = now - int(time.monotonic() * 1e9)

    def perf_ns(self, t: float) -> int:
        return self._perf_ns + int(t * 1e9)

    def mono_ns(self, t: float) -> int:
        return self._mono_ns + int(t * 1e9)

    def begin(
        self, name: str, carrier: Mapping[str, str], request_id: str, model: str,
        version: str, started: float, attributes: Mapping[str, Any] | None = None,
    ) -> RequestTrace:  # fmt: skip
        """The server span of one request, a child of the client's ``traceparent`` (in
        ``carrier``, lower-case names) when it sent a valid one, sampled as the SDK's
        ``ParentBased(TraceIdRatioBased)`` would; ``started``: perf_counter time. Only ids
        and times are kept: the spans are made in the exporter process."""
        parent = _parent(carrier.get("traceparent"))
        if parent is not None:
            trace_id, parent_id, sampled = parent
            tracestate = carrier.get("tracestate")
            if tracestate is not None:  # the SDK's propagator keeps only its valid members
                from opentelemetry.trace.span import TraceState

                tracestate = TraceState.from_header([tracestate]).to_header() or None
        else:
            trace_id = getrandbits(128) or 1
            parent_id, tracestate = 0, None
            sampled = (trace_id & 0xFFFFFFFFFFFFFFFF) < self.bound
        return RequestTrace(
            self, name, trace_id, getrandbits(64) or 1, parent_id, sampled, tracestate,
            self.perf_ns(started),
            {"mserve.model": model, "mserve.model_version": version,
             "mserve.request_id": request_id, **(attributes or {})},
        )  # fmt: skip

    @contextlib.contextmanager
    def span(self, name: str, attributes: Mapping[str, Any]) -> Iterator[None]:
        """A span around server work that is no request (a model load, an environment build):
        a child of the work span around it in this task, else a new trace sampled by the
        ratio; an exception escaping it is recorded on it."""
        outer = _work.get()
        if outer is None:
            trace_id = getrandbits(128) or 1
            trace_hex, parent_id = f"{trace_id:032x}", 0
            sampled = (trace_id & 0xFFFFFFFFFFFFFFFF) < self.bound
        else:
            trace_hex, parent_id, sampled = outer
        span_id = getrandbits(64) or 1
        token = _work.set((trace_hex, span_id, sampled))
        start, error = time.time_ns(), None
        try:
            yield
        except BaseException as exc:
            error = (type(exc).__qualname__, str(exc))
            raise
        finally:
            _work.reset(token)
            if sampled:
                self.sink.put((
                    "s", name, trace_hex, span_id, parent_id, start, time.time_ns(),
                    dict(attributes), error,
                ))  # fmt: skip

    def start(self) -> None:
        """Start the exporter process (on the server's event loop)."""
        self.sink.start()

    async def close(self) -> None:
        """Export what is still queued (bounded), then stop the exporter process."""
        await self.sink.close()

    def dropped(self) -> dict[str, int]:
        """Spans lost, by reason (``mserve_trace_spans_dropped_total``)."""
        return dict(self.sink.dropped)


# (trace id, span id, sampled) of the work span (a model load) the current task is inside
_work: contextvars.ContextVar[tuple[str, int, bool] | None] = contextvars.ContextVar(
    "mserve_work_span", default=None
)


def _parent(traceparent: str | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a valid W3C ``traceparent``, else None."""
    if traceparent is None or len(traceparent) != 55 or not _TRACEPARENT.match(traceparent):
        return None
    trace_id, parent_id = int(traceparent[3:35], 16), int(traceparent[36:52], 16)
    if traceparent[:2] == "ff" or not trace_id or not parent_id:
        return None
    return trace_id, parent_id, bool(int(traceparent[53:55], 16) & 1)


class RequestTrace:
    """One request's server span while it runs: its ids, and at the end the times its
    children are made from, handed to the exporter process as one record when sampled."""

    __slots__ = (
        "attributes", "name", "parent_id", "popped", "sampled", "span_id", "start", "trace_id",
        "traceparent", "tracestate", "tracing",
    )  # fmt: skip

    def __init__(
        self, tracing: Tracing, name: str, trace_id: int, span_id: int, parent_id: int,
        sampled: bool, tracestate: str | None, start: int, attributes: dict[str, Any],
    ) -> None:  # fmt: skip
        self.tracing = tracing
        self.name = name
        self.trace_id = f"{trace_id:032x}"
        self.span_id = span_id
        self.parent_id = parent_id
        self.sampled = sampled
        self.tracestate = tracestate
        self.traceparent = f"00-{self.trace_id}-{span_id:016x}-{'01' if sampled else '00'}"
        self.start = start
        self.attributes = attributes
        self.popped = 0.0  # monotonic: taken off the queue into a batch (0: sent at once)

    def pass_on(self, headers: list[list[str]]) -> None:
        """The handler's view: the request's ``traceparent`` becomes this span's (appended
        last, where the worker looks for it first), a client's own one replaced."""
        if any(k.lower() in ("traceparent", "tracestate") for k, _ in headers):
            headers[:] = [h for h in headers if h[0].lower() not in ("traceparent", "tracestate")]
        if self.tracestate:
            headers.append(["tracestate", self.tracestate])
        headers.append(["traceparent", self.traceparent])

    def finish(
        self, job: QueuedJob | None, status: int, error: str | None = None,
        stream: tuple[float, int] | None = None,
    ) -> None:  # fmt: skip
        """End the request (nothing at all when it is not sampled): the times of ``job`` its
        children are made from, ``status``; ``error`` marks it failed; ``stream``:
        (perf_counter time of the first chunk, chunks) for a streamed answer."""
        if not self.sampled:
            return
        tracing = self.tracing
        end = time.time_ns()
        answered = end if stream is None else tracing.perf_ns(stream[0])
        streamed = None if stream is None else (answered, stream[1])
        if job is None:
            children = (None, 0, 0, answered, "", 0, None, None, streamed)
        elif not job.sent_at:  # never reached a worker
            enqueued = tracing.mono_ns(job.enqueued_at)
            children = (enqueued, 0, 0, answered, "", 0, None, None, streamed)
        else:
            worker, batch = job.sent  # type: ignore[misc]
            sent = tracing.mono_ns(job.sent_at)
            meta = job.handled
            if meta is None:
                meta = _result_meta(batch)
                size = len(batch.jobs) if batch.jobs is not None else 1
            else:  # a continuous-batching step: the requests it held
                size = meta["batch_size"]
            children = (
                tracing.mono_ns(job.enqueued_at),
                tracing.mono_ns(self.popped) if self.popped else sent, sent, answered,
                str(worker.id), size, meta.get("handler_ms"), meta.get("phases"), streamed,
            )  # fmt: skip
        tracing.sink.put((
            "q", self.name, self.trace_id, self.span_id, self.parent_id, self.tracestate,
            self.start, end, status, error, self.attributes, children,
        ))  # fmt: skip


def _result_meta(batch: Any) -> dict[str, Any]:
    future = batch.future
    if not future.done() or future.cancelled() or future.exception() is not None:
        return {}
    meta = future.result().meta
    return meta if isinstance(meta, dict) else {}
