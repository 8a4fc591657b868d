"""OpenTelemetry traces of requests, model loads and environment builds (docs/observability.md).

Off unless an OTLP endpoint is configured (``otel_endpoint``, or the standard
``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``); off, :data:`current` is None and the request path
creates nothing at all. On, each request gets one server span, started when the request
arrived, whose context travels to the worker as the request's ``traceparent`` header (so the
handler's own spans join the trace). The frontend keeps only ids and times: when a sampled
request ends, one compact record of them goes to the span exporter process, which makes the
server span and its children (queue wait, batch assembly, the worker's round trip, the handler
call and its phases, streaming), encodes them and sends them over OTLP. The frontend never
imports the SDK.

- :mod:`.settings`: what tracing the server does, from its settings and the ``OTEL_*``
  variables.
- :mod:`.context`: the frontend's side: a request's span while it runs, spans around server
  work, sampling, the ids the access log names.
- :mod:`.process`: the exporter process's parent side (its queue, pipe and supervision).
- :mod:`.export`: the exporter process (``python -m server.tracing.export``): records to spans.
- :mod:`.otlp`: OTLP's protobuf encoding of spans, by hand; :mod:`.senders`: OTLP/HTTP and
  OTLP/gRPC.

This module holds the server's tracing (:data:`current`, set once by :func:`setup`) and what the
request path calls; callers read ``tracing.current`` through this module, which ``setup`` sets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import urllib.parse
from collections.abc import Mapping
from typing import Any

from server.errors import MserveError
from server.tracing.context import (
    CLIENT_GONE,
    RequestTrace,
    Tracing,
    client_request_id,
    trace_id_of,
)
from server.tracing.settings import TraceConfig, trace_settings

__all__ = [
    "CLIENT_GONE",
    "RequestTrace",
    "Tracing",
    "client_request_id",
    "current",
    "refused",
    "setup",
    "span",
    "trace_id_of",
]

log = logging.getLogger(__name__)

# The server's tracing, set once at start by setup(); None: off (the request path checks it).
current: Tracing | None = None


def refused(
    name: str, carrier: Mapping[str, str], request_id: str, model: str, version: str,
    started: float, attributes: Mapping[str, Any], error: MserveError,
) -> str:  # fmt: skip
    """A request refused before it was queued (no such model, say): while tracing, its server
    span, begun and ended with its error at once, as an HTTP server's instrumentation makes one
    for every request; its trace id either way (the client's, when not tracing; "" if none)."""
    if current is None:
        return trace_id_of(carrier.get("traceparent"))
    trace = current.begin(name, carrier, request_id, model, version, started, attributes)
    trace.finish(None, error.status, error.message)
    return trace.trace_id


def setup(config: TraceConfig, environ: Mapping[str, str] | None = None) -> Tracing | None:
    """Tracing as configured; its exporter process starts with the event loop (``start``)."""
    global current
    settings = trace_settings(config, os.environ if environ is None else environ)
    if settings is None:
        current = None
        return None
    from server.tracing.process import ExportProcess

    current = Tracing(settings, ExportProcess(settings))
    log.info(
        "tracing: OTLP %s to %s, sampling %g of new traces",
        settings.protocol, settings.endpoint, settings.sampling_ratio,
    )  # fmt: skip
    return current


def collector_warning(timeout_s: float = 0.5) -> str | None:
    """Whether the OTLP collector takes a connection, asked once at start so that the start
    banner says a collector that is down (the exporter's failures reach the log only after its
    first batch's retries); None when it does, or when tracing is off."""
    if current is None:
        return None
    url = urllib.parse.urlsplit(current.settings.endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout_s):
            return None
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        return (
            f"tracing: the OTLP collector at {url.hostname}:{port} does not answer ({why});"
            " spans are dropped until it does"
        )


_NO_SPAN = contextlib.nullcontext()


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[None]:
    """A span for server work (model load, environment build); nothing at all when off."""
    tracing = current
    if tracing is None:
        return _NO_SPAN
    return tracing.span(name, attributes)
