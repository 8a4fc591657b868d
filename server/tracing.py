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
from typing import TYPE_CHECKING, Any

from server.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from server.config import ServerConfig
    from server.models.batching import Job

log = logging.getLogger(__name__)

PROTOCOLS = ("http/protobuf", "grpc")
# W3C trace context: version 00, 32 hex trace id, 16 hex parent id, 2 hex flags
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
# X-Request-ID: what we take from a client, else we make our own (server/rest/inference.py)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
_PHASES = ("preprocess", "inference", "postprocess")
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

    def __init__(self, settings: TraceSettings, tracer: Tracer, shutdown: Callable[[], None]):
        self.settings = settings
        self.tracer = tracer
        self._shutdown = shutdown
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
        ``carrier``, lower-case names) when it sent one; ``started``: perf_counter time."""
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(carrier)
        span = self.tracer.start_span(
            name,
            context=parent,
            kind=SpanKind.SERVER,
            start_time=self.perf_ns(started),
            attributes={
                "mserve.model": model,
                "mserve.model_version": version,
                "mserve.request_id": request_id,
                **(attributes or {}),
            },
        )
        out: dict[str, str] = {}
        context = set_span_in_context(span)
        TraceContextTextMapPropagator().inject(out, context)
        return RequestTrace(self, span, context, out.get("traceparent", ""), out.get("tracestate"))

    @contextlib.contextmanager
    def span(self, name: str, attributes: Mapping[str, Any]) -> Iterator[None]:
        """A span around server work that is no request (a model load, an environment build);
        an exception escaping it is recorded on it."""
        with self.tracer.start_as_current_span(name, attributes=dict(attributes)):
            yield

    def shutdown(self) -> None:
        """Export what is still buffered (bounded by the SDK's export timeout)."""
        self._shutdown()


class RequestTrace:
    """One request's server span, and the times its children are made from."""

    __slots__ = ("context", "popped", "span", "traceparent", "tracestate", "tracing")

    def __init__(
        self, tracing: Tracing, span: Span, context: Any, traceparent: str,
        tracestate: str | None,
    ) -> None:  # fmt: skip
        self.tracing = tracing
        self.span = span
        self.context = context
        self.traceparent = traceparent
        self.tracestate = tracestate
        self.popped = 0.0  # monotonic: taken off the queue into a batch (0: sent at once)

    @property
    def trace_id(self) -> str:
        return self.traceparent[3:35]

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
        """End the request: its children from ``job``'s times, then the server span with
        ``status``; ``error`` marks it failed; ``stream``: (perf_counter time of the first
        chunk, chunks) for a streamed answer."""
        from opentelemetry.trace import Status, StatusCode

        tracing, span = self.tracing, self.span
        end = time.time_ns()
        if job is not None:
            self._children(job, end if stream is None else tracing.perf_ns(stream[0]))
        if stream is not None:
            child = tracing.tracer.start_span(
                "mserve.stream", self.context, start_time=tracing.perf_ns(stream[0]),
                attributes={"mserve.chunks": stream[1]},
            )  # fmt: skip
            child.end(end)
        span.set_attribute("http.response.status_code", status)
        if error is not None or status >= 500:
            span.set_status(Status(StatusCode.ERROR, error))
            if error is not None:
                span.add_event("exception", {"exception.message": error})
        span.end(end)

    def _children(self, job: Job, answered: int) -> None:
        tracing, tracer, parent = self.tracing, self.tracing.tracer, self.context
        enqueued = tracing.mono_ns(job.enqueued_at)
        if not job.sent_at:  # never reached a worker
            tracer.start_span("mserve.queue", parent, start_time=enqueued).end(answered)
            return
        sent = tracing.mono_ns(job.sent_at)
        popped = tracing.mono_ns(self.popped) if self.popped else sent
        tracer.start_span("mserve.queue", parent, start_time=enqueued).end(popped)
        worker, batch = job.sent  # type: ignore[misc]
        size = len(batch.jobs) if batch.jobs is not None else 1
        tracer.start_span(
            "mserve.batch", parent, start_time=popped, attributes={"mserve.batch_size": size}
        ).end(sent)
        self.span.set_attribute("mserve.worker_id", str(worker.id))
        self.span.set_attribute("mserve.batch_size", size)
        call = tracer.start_span(
            "mserve.worker", parent, start_time=sent,
            attributes={"mserve.worker_id": str(worker.id), "mserve.batch_size": size},
        )  # fmt: skip
        meta = _result_meta(batch)
        handler_ms = meta.get("handler_ms")
        if type(handler_ms) in (int, float) and handler_ms >= 0:
            from opentelemetry.trace import set_span_in_context

            start = max(sent, answered - int(handler_ms * 1e6))
            inner = set_span_in_context(call, parent)
            handler = tracer.start_span("mserve.handler", inner, start_time=start)
            phases = meta.get("phases")
            if type(phases) is list:
                in_handler = set_span_in_context(handler, parent)
                for phase in phases:
                    if (
                        type(phase) is list and len(phase) == 3 and phase[0] in _PHASES
                        and all(type(x) in (int, float) and x >= 0 for x in phase[1:])
                    ):  # fmt: skip
                        begin = start + int(phase[1] * 1e6)
                        tracer.start_span(f"mserve.{phase[0]}", in_handler, start_time=begin).end(
                            min(answered, begin + int(phase[2] * 1e6))
                        )
            handler.end(answered)
        call.end(answered)


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
    provider.add_span_processor(BatchSpanProcessor(exporter))
    current = Tracing(settings, provider.get_tracer("mserve"), provider.shutdown)
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
