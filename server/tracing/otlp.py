"""OTLP's protobuf wire format for spans, written by hand for the span exporter process
(server/tracing/export.py): the SDK's path (a ReadableSpan per span, then opentelemetry-proto's
message objects, then serialization) cost ~20 us a span; writing the few fields we use straight
to bytes costs a fraction of that (docs/observability.md). The bytes are those the SDK's
encoder gives for the same span (tests/server/test_tracing_otlp.py compares them byte for byte):
fields in field-number order, proto3's defaults left out, a oneof's value always written.

Messages (opentelemetry/proto/trace/v1/trace.proto, common/v1/common.proto): a request is
``ResourceSpans{resource, ScopeSpans{scope, spans...}}``; the resource and scope are encoded once
(``Batch``) and each span once, so a batch costs their concatenation. The senders post a
request's bytes as they are (server/tracing/senders.py).
"""

from __future__ import annotations

import struct
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
