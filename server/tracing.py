"""OpenTelemetry traces of requests, model loads and environment builds (docs/server.md,
Observability).

Off unless an OTLP endpoint is configured (``otel_endpoint``, or the standard
``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``); off, :data:`current` is None, the SDK is never
imported and the request path creates no span object at all. On, each request gets one server
span, started when the request arrived, whose context travels to the worker as the request's
``traceparent`` header (so the handler's own spans join the trace); its children (queue wait,
batch assembly, the worker's round trip, the handler call and its phases, streaming) are made
when the request ends, from the times the server and the worker recorded, so nothing but the
server span lives while the request waits. Spans leave through the SDK's batch processor, on
its own thread, off the request path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from random import getrandbits
from typing import TYPE_CHECKING, Any

from server.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.trace import Tracer

    from server.config import ServerConfig
    from server.models.batching import Job

log = logging.getLogger(__name__)

PROTOCOLS = ("http/protobuf", "grpc")
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


@dataclass(frozen=True)
class TraceSettings:
    endpoint: str
    protocol: str
    sampling_ratio: float
    headers: dict[str, str]


def trace_settings(config: ServerConfig, environ: Mapping[str, str]) -> TraceSettings | None:
    """What tracing the server does: None (off) without an endpoint, or with
    ``OTEL_SDK_DISABLED=true`` / ``OTEL_TRACES_EXPORTER=none``. Our settings win over the
    standard variables; bad values are refused with the setting's name."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    protocol = (
        config.otel_protocol
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"'otel_protocol' should be one of {', '.join(PROTOCOLS)}, found {protocol!r}"
        )
    endpoint = config.otel_endpoint
    if not endpoint:
        traces = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if traces:
            endpoint = traces
        elif base:  # the base URL: OTLP/HTTP appends the signal's path
            endpoint = base.rstrip("/") + "/v1/traces" if protocol == "http/protobuf" else base
    if not endpoint:
        return None
    if not re.match(r"^https?://[^/\s]+", endpoint):
        raise ConfigError(
            f"'otel_endpoint' should be an http:// or https:// URL, found {endpoint!r}"
        )
    ratio = config.otel_sampling_ratio
    if ratio is None:
        raw = environ.get("OTEL_TRACES_SAMPLER_ARG")
        try:
            ratio = float(raw) if raw else 1.0
        except ValueError:
            raise ConfigError(
                f"OTEL_TRACES_SAMPLER_ARG should be a number from 0 to 1, found {raw!r}"
            ) from None
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"'otel_sampling_ratio' should be from 0 to 1, found {ratio!r}")
    headers = {}
    for pair in (environ.get("OTEL_EXPORTER_OTLP_HEADERS") or "").split(","):
        key, sep, value = pair.partition("=")
        if sep and key.strip():
            headers[key.strip()] = value.strip()
    return TraceSettings(endpoint, protocol, ratio, headers)


class Tracing:
    """The server's tracer and exporter, while tracing is on."""

    def __init__(
        self, settings: TraceSettings, tracer: Tracer, processor: SpanProcessor,
        shutdown: Callable[[], None],
    ) -> None:  # fmt: skip
        self.settings = settings
        self.tracer = tracer
        self.processor = processor
        self._shutdown = shutdown
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
        and times are kept: the span objects are made on the export thread (the SDK's cost
        ~150 us of frontend CPU per request with its children)."""
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
        """A span around server work that is no request (a model load, an environment build);
        an exception escaping it is recorded on it."""
        with self.tracer.start_as_current_span(name, attributes=dict(attributes)):
            yield

    def shutdown(self) -> None:
        """Export what is still buffered (bounded by the SDK's export timeout)."""
        self._shutdown()


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
    children are made from. Handed whole to the SDK's batch span processor when sampled (its
    ``context`` says so); :class:`_Expand` makes the spans on the export thread."""

    __slots__ = (
        "attributes", "children", "end", "error", "name", "parent_id", "popped", "sampled",
        "span_id", "start", "status", "trace_id", "traceparent", "tracestate", "tracing",
    )  # fmt: skip

    context: Any = None  # set by setup(): a sampled SpanContext, all the processor looks at

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
        self.end = 0
        self.status = 0
        self.error: str | None = None
        # (enqueued, popped, sent, answered ns, worker id, batch size, result meta, stream)
        self.children: tuple[Any, ...] | None = None

    def pass_on(self, headers: list[list[str]]) -> None:
        """The handler's view: the request's ``traceparent`` becomes this span's (appended
        last, where the worker looks for it first), a client's own one replaced."""
        if any(k.lower() in ("traceparent", "tracestate") for k, _ in headers):
            headers[:] = [h for h in headers if h[0].lower() not in ("traceparent", "tracestate")]
        if self.tracestate:
            headers.append(["tracestate", self.tracestate])
        headers.append(["traceparent", self.traceparent])

    def finish(
        self, job: Job | None, status: int, error: str | None = None,
        stream: tuple[float, int] | None = None,
    ) -> None:  # fmt: skip
        """End the request (nothing at all when it is not sampled): the times of ``job`` its
        children are made from, ``status``; ``error`` marks it failed; ``stream``:
        (perf_counter time of the first chunk, chunks) for a streamed answer."""
        if not self.sampled:
            return
        tracing = self.tracing
        self.end = end = time.time_ns()
        self.status, self.error = status, error
        answered = end if stream is None else tracing.perf_ns(stream[0])
        streamed = None if stream is None else (answered, stream[1])
        if job is None:
            self.children = (None, 0, 0, answered, "", 0, None, streamed)
        elif not job.sent_at:  # never reached a worker
            enqueued = tracing.mono_ns(job.enqueued_at)
            self.children = (enqueued, 0, 0, answered, "", 0, None, streamed)
        else:
            worker, batch = job.sent  # type: ignore[misc]
            sent = tracing.mono_ns(job.sent_at)
            self.children = (
                tracing.mono_ns(job.enqueued_at),
                tracing.mono_ns(self.popped) if self.popped else sent, sent, answered,
                str(worker.id), len(batch.jobs) if batch.jobs is not None else 1,
                _result_meta(batch), streamed,
            )  # fmt: skip
        tracing.processor.on_end(self)  # type: ignore[arg-type]


def _result_meta(batch: Any) -> dict[str, Any]:
    future = batch.future
    if not future.done() or future.cancelled() or future.exception() is not None:
        return {}
    meta = future.result().meta
    return meta if isinstance(meta, dict) else {}


# The server's tracing, set once at start by setup(); None: off (the request path checks it).
current: Tracing | None = None


def setup(config: ServerConfig, environ: Mapping[str, str] | None = None) -> Tracing | None:
    """Start tracing when configured (the SDK and the chosen exporter are imported only then)."""
    global current
    settings = trace_settings(config, os.environ if environ is None else environ)
    if settings is None:
        current = None
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, TraceFlags

    from server.tracing_export import Expand

    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    from archiver import __version__

    resource = Resource.create({"service.name": "mserve", "service.version": __version__})
    if os.environ.get("OTEL_SERVICE_NAME"):  # Resource.create read it; ours must not win
        resource = Resource.create({"service.version": __version__})
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sampling_ratio))
    )
    exporter = OTLPSpanExporter(endpoint=settings.endpoint, headers=settings.headers or None)
    processor = BatchSpanProcessor(Expand(exporter, resource, InstrumentationScope("mserve")))
    provider.add_span_processor(processor)
    RequestTrace.context = SpanContext(1, 1, False, TraceFlags(TraceFlags.SAMPLED))
    current = Tracing(settings, provider.get_tracer("mserve"), processor, provider.shutdown)
    log.info(
        "tracing: OTLP %s to %s, sampling %g of new traces",
        settings.protocol, settings.endpoint, settings.sampling_ratio,
    )  # fmt: skip
    return current


_NO_SPAN = contextlib.nullcontext()


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[None]:
    """A span for server work (model load, environment build); nothing at all when off."""
    tracing = current
    if tracing is None:
        return _NO_SPAN
    return tracing.span(name, attributes)
