"""OTLP's protobuf wire format for spans, written by hand for the span exporter process
(server/tracing_export.py): the SDK's path (a ReadableSpan per span, then opentelemetry-proto's
message objects, then serialization) cost ~20 us a span; writing the few fields we use straight
to bytes costs a fraction of that (docs/server.md, Observability). The bytes are those the SDK's
encoder gives for the same span (tests/server/test_tracing_otlp.py compares them byte for byte):
fields in field-number order, proto3's defaults left out, a oneof's value always written.

Messages (opentelemetry/proto/trace/v1/trace.proto, common/v1/common.proto): a request is
``ResourceSpans{resource, ScopeSpans{scope, spans...}}``; the resource and scope are encoded once
(``Batch``) and each span once, so a batch costs their concatenation. The senders post a
request's bytes as they are: OTLP/HTTP over one kept-alive connection, gRPC through
TraceService's ``Export`` method.
"""

from __future__ import annotations

import gzip
import http.client
import os
import random
import ssl
import struct
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

_FIXED64 = struct.Struct("<Q").pack
_DOUBLE = struct.Struct("<d").pack
_BYTE = [bytes((i,)) for i in range(128)]
_CACHE_MAX = 4096  # encoded attributes kept: models, versions, workers, codes repeat

# Span.kind (SpanKind): what the SDK's INTERNAL and SERVER become
KIND_INTERNAL, KIND_SERVER = 1, 2
# Status.code
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2
# Span.flags: SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK, with _IS_REMOTE_MASK for a remote parent
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", 0x100)
_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", 0x300)
_UNSET_LOCAL, _UNSET_REMOTE = b"\x7a\x00" + _FLAGS_LOCAL, b"\x7a\x00" + _FLAGS_REMOTE
_KIND = {k: b"\x30" + bytes((k,)) for k in range(1, 6)}
_TIMES = struct.Struct("<BQBQ").pack  # start_time_unix_nano, end_time_unix_nano: fixed64


def varint(n: int) -> bytes:
    """A protobuf varint; a negative int64 as its 10-byte two's complement, as protobuf does."""
    if 0 <= n < 128:
        return _BYTE[n]
    if n < 0:
        n &= (1 << 64) - 1
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, data: bytes) -> bytes:
    """A length-delimited field: tag, length, data."""
    n = len(data)
    return tag + (_BYTE[n] if n < 128 else varint(n)) + data


def any_value(value: Any) -> bytes:
    """An ``AnyValue``, as the SDK's ``_encode_value`` makes it (None: an empty one)."""
    kind = type(value)
    if kind is str:
        return _field(b"\x0a", value.encode("utf-8", "surrogatepass"))
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is int:
        if not -(1 << 63) <= value < 1 << 63:
            raise ValueError(f"{value} does not fit an int64")
        return b"\x18" + varint(value)
    if kind is float:
        return b"\x21" + _DOUBLE(value)
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return any_value(str(value))
    if isinstance(value, int):
        return any_value(int(value))
    if isinstance(value, float):
        return any_value(float(value))
    if isinstance(value, bytes):
        return _field(b"\x3a", bytes(value))
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", any_value(v)) for v in value))
    if isinstance(value, Mapping):
        return _field(b"\x32", b"".join(_field(b"\x0a", key_value(k, v)) for k, v in value.items()))
    raise TypeError(f"an attribute value of type {kind.__name__} cannot be encoded: {value!r}")


def key_value(key: str, value: Any) -> bytes:
    """A ``KeyValue``."""
    return _field(b"\x0a", key.encode("utf-8", "surrogatepass")) + _field(b"\x12", any_value(value))


class Encoder:
    """Encodes spans, keeping the encoding of what repeats from span to span (attribute pairs,
    names, tracestates): most of a span is then a few byte strings joined."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, str, type, Any], bytes] = {}
        self._strings: dict[tuple[bytes, str], bytes] = {}

    def attributes(self, tag: int, attributes: Mapping[str, Any] | None) -> bytes:
        """The ``KeyValue`` fields (number ``tag``) of ``attributes``."""
        if not attributes:
            return b""
        seen, parts = self._seen, []
        for key, value in attributes.items():
            kind = type(value)
            cacheable = kind is str or kind is int or kind is bool or kind is float
            if cacheable:
                encoded = seen.get((tag, key, kind, value))
                if encoded is not None:
                    parts.append(encoded)
                    continue
            try:
                encoded = _field(_BYTE[tag << 3 | 2], key_value(key, value))
            except (TypeError, ValueError, AttributeError):  # as the SDK: that one is left out
                continue
            if cacheable:
                if len(seen) >= _CACHE_MAX:
                    seen.clear()
                seen[(tag, key, kind, value)] = encoded
            parts.append(encoded)
        return b"".join(parts)

    def _string(self, tag: bytes, text: str) -> bytes:
        encoded = self._strings.get((tag, text))
        if encoded is None:
            if len(self._strings) >= _CACHE_MAX:
                self._strings.clear()
            encoded = _field(tag, text.encode("utf-8", "surrogatepass"))
            self._strings[(tag, text)] = encoded
        return encoded

    def span(
        self, trace_id: bytes, span_id: int, trace_state: str, parent_id: int,
        remote_parent: bool, name: str, kind: int, start: int, end: int,
        attributes: Mapping[str, Any] | None,
        events: Sequence[tuple[str, int, Mapping[str, Any]]], status: int, message: str,
    ) -> bytes:  # fmt: skip
        """One ``Span``, as a ``ScopeSpans.spans`` field: ``trace_id`` 16 bytes, ids ints
        (``parent_id`` 0: a root), times the epoch's nanoseconds, ``events`` (name, time,
        attributes), ``status`` a Status code with its ``message``."""
        parts = [b"\x0a\x10", trace_id, b"\x12\x08", span_id.to_bytes(8, "big")]
        if trace_state:
            parts.append(self._string(b"\x1a", trace_state))
        if parent_id:
            parts += (b"\x22\x08", parent_id.to_bytes(8, "big"))
        parts += (self._string(b"\x2a", name), _KIND[kind], _TIMES(0x39, start, 0x41, end))
        if attributes:
            parts.append(self.attributes(9, attributes))
        for event_name, time_ns, event_attributes in events:
            event = (b"\x09" + _FIXED64(time_ns) + self._string(b"\x12", event_name)
                     + self.attributes(3, event_attributes))  # fmt: skip
            parts.append(_field(b"\x5a", event))
        if status or message:
            text = message.encode("utf-8", "surrogatepass")
            encoded = (_field(b"\x12", text) if text else b"") + (
                b"\x18" + _BYTE[status] if status else b""
            )
            parts.append(_field(b"\x7a", encoded))
            parts.append(_FLAGS_REMOTE if remote_parent else _FLAGS_LOCAL)
        else:  # an empty Status, as the SDK always sends one
            parts.append(_UNSET_REMOTE if remote_parent else _UNSET_LOCAL)
        data = b"".join(parts)
        n = len(data)
        return (b"\x12" + _BYTE[n] if n < 128 else b"\x12" + varint(n)) + data


class Batch:
    """An ``ExportTraceServiceRequest`` of one resource and one scope: ``request(spans)`` wraps
    spans from ``Encoder.span`` (each already a ``ScopeSpans.spans`` field)."""

    def __init__(
        self, resource: Mapping[str, Any], scope_name: str, scope_version: str = ""
    ) -> None:
        attrs = Encoder()
        scope = _field(b"\x0a", scope_name.encode())
        if scope_version:
            scope += _field(b"\x12", scope_version.encode())
        self._resource = _field(b"\x0a", attrs.attributes(1, resource))
        self._scope = _field(b"\x0a", scope)

    def request(self, spans: Sequence[bytes]) -> bytes:
        scope_spans = _field(b"\x12", self._scope + b"".join(spans))
        return _field(b"\x0a", self._resource + scope_spans)


# --- sending ------------------------------------------------------------------------------

MAX_TRIES = 6  # as the SDK's exporters: backoff 1, 2, 4, ... s (+-20%) within the timeout
_HTTP_RETRY = frozenset({429, 502, 503, 504})


def _env(name: str, default: str = "") -> str:
    """``OTEL_EXPORTER_OTLP_TRACES_<name>``, else ``OTEL_EXPORTER_OTLP_<name>``."""
    return (
        os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}")
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}")
        or default
    ).strip()


def export_options(headers: Mapping[str, str]) -> dict[str, Any]:
    """What the SDK's exporters read from the environment: headers (the variables', then
    ``headers``: ours win), timeout (seconds, as the SDK reads it), compression, certificate."""
    from opentelemetry.util.re import parse_env_headers

    merged = {k.lower(): v for k, v in parse_env_headers(_env("HEADERS"), liberal=True).items()}
    merged.update({k.lower(): v for k, v in headers.items()})
    try:
        timeout_s = float(_env("TIMEOUT", "10"))
    except ValueError:
        timeout_s = 10.0
    compression = _env("COMPRESSION", "none").lower()
    if compression not in ("none", "gzip", "deflate"):
        compression = "none"
    return {"headers": merged, "timeout_s": timeout_s, "compression": compression,
            "certificate": _env("CERTIFICATE") or None, "insecure": _env("INSECURE")}  # fmt: skip


def _backoff(attempt: int, deadline: float) -> bool:
    """Sleep before try ``attempt + 1``; False when that would pass the deadline."""
    wait = 2**attempt * random.uniform(0.8, 1.2)
    if attempt + 1 >= MAX_TRIES or time.monotonic() + wait > deadline:
        return False
    time.sleep(wait)
    return True


class HttpSender:
    """OTLP/HTTP (protobuf) over one kept-alive connection, reopened when the collector
    closes it."""

    def __init__(self, endpoint: str, options: dict[str, Any]) -> None:
        url = urllib.parse.urlsplit(endpoint)
        self._https = url.scheme == "https"
        self._host = url.hostname or "localhost"
        self._port = url.port or (443 if self._https else 80)
        self._path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self._timeout_s = options["timeout_s"]
        self._compression = options["compression"]
        self._headers = {"Content-Type": "application/x-protobuf", **options["headers"]}
        if self._compression != "none":
            self._headers.setdefault("content-encoding", self._compression)
        self._certificate = options["certificate"]
        self._conn: http.client.HTTPConnection | None = None

    def _post(self, data: bytes, timeout_s: float) -> tuple[int, str]:
        conn = self._conn
        if conn is None:
            if self._https:
                context = ssl.create_default_context(cafile=self._certificate)
                conn = http.client.HTTPSConnection(self._host, self._port, context=context)
            else:
                conn = http.client.HTTPConnection(self._host, self._port)
            self._conn = conn
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        conn.request("POST", self._path, data, self._headers)
        reply = conn.getresponse()
        reply.read()
        if reply.will_close:
            self.close()
        return reply.status, reply.reason

    def send(self, data: bytes) -> str | None:
        """Post one request; None once the collector took it, else why not."""
        if self._compression == "gzip":
            data = gzip.compress(data)
        elif self._compression == "deflate":
            import zlib

            data = zlib.compress(data)
        deadline = time.monotonic() + self._timeout_s
        attempt = 0
        while True:
            reused = self._conn is not None and self._conn.sock is not None
            try:
                status, reason = self._post(data, max(deadline - time.monotonic(), 0.001))
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if reused:  # the collector closed the kept-alive connection: once more, now
                    continue
                failure = f"Failed to export spans batch: {exc or type(exc).__name__}"
            else:
                if 200 <= status < 400:
                    return None
                failure = f"Failed to export spans batch code: {status}, reason: {reason}"
                if status not in _HTTP_RETRY:
                    return failure
            if not _backoff(attempt, deadline):
                return failure
            attempt += 1

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class GrpcSender:
    """OTLP/gRPC: TraceService's ``Export``, its path taken from the generated descriptor,
    sending the encoded request as it is (the generated stub would parse and re-serialize it)."""

    def __init__(self, endpoint: str, options: dict[str, Any]) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        url = urllib.parse.urlsplit(endpoint)
        target = url.netloc or endpoint
        if ":" not in target.rsplit("]", 1)[-1]:
            target += ":4317"
        insecure = url.scheme == "http"
        if options["insecure"]:
            insecure = options["insecure"].lower() == "true"
        compression = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}.get(
            options["compression"], grpc.Compression.NoCompression
        )
        if insecure:
            self._channel = grpc.insecure_channel(target, compression=compression)
        else:
            roots = None
            if options["certificate"]:
                with open(options["certificate"], "rb") as file:
                    roots = file.read()
            credentials = grpc.ssl_channel_credentials(root_certificates=roots)
            self._channel = grpc.secure_channel(target, credentials, compression=compression)
        service = trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"]
        self._export = self._channel.unary_unary(
            f"/{service.full_name}/{service.methods_by_name['Export'].name}",
            request_serializer=None,  # bytes, already encoded
            response_deserializer=trace_service_pb2.ExportTraceServiceResponse.FromString,
        )
        self._metadata = tuple(options["headers"].items())
        self._timeout_s = options["timeout_s"]
        self._grpc = grpc

    def send(self, data: bytes) -> str | None:
        """Call Export once; None once the collector took it, else why not."""
        code = self._grpc.StatusCode
        retry = {code.CANCELLED, code.DEADLINE_EXCEEDED, code.RESOURCE_EXHAUSTED, code.ABORTED,
                 code.OUT_OF_RANGE, code.UNAVAILABLE, code.DATA_LOSS}  # fmt: skip
        deadline = time.monotonic() + self._timeout_s
        attempt = 0
        while True:
            try:
                self._export(data, metadata=self._metadata,
                             timeout=max(deadline - time.monotonic(), 0.001))  # fmt: skip
                return None
            except self._grpc.RpcError as exc:
                status = exc.code() if hasattr(exc, "code") else None
                details = exc.details() if hasattr(exc, "details") else str(exc)
                name = getattr(status, "name", status)
                failure = f"Failed to export spans batch, error code: {name}, details: {details}"
                if status not in retry or not _backoff(attempt, deadline):
                    return failure
            attempt += 1

    def close(self) -> None:
        self._channel.close()
