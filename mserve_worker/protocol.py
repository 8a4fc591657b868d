"""The frame codec spoken between the server and its worker processes.

Sans-IO on purpose: both sides own their own transport (asyncio streams in the server, a blocking
socket in the worker), and a codec that only turns bytes into frames can be tested byte for byte
and reused by a worker written in another language. It runs inside every model's environment, so
it imports the standard library only and keeps to Python 3.8. The wire format is described in
``docs/protocol.md``; keep the two in step.
"""

from __future__ import annotations

import enum
import itertools
import json
import json.encoder
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# 2: CANCEL, for batches pipelined behind a running one; 3: CHUNK; 4: packed BATCH entries
PROTOCOL_VERSION = 5
MAGIC = b"MS"
# magic, version, kind, flags, meta_len, payload_len, then 2 reserved zero bytes ("2x" packs zeros
# and unpacks to nothing) so the header is 16 bytes and meta starts aligned.
HEADER = struct.Struct(">2sBBHII2x")
_HEADER_ALL = struct.Struct(">2sBBHIIH")  # the same, reserved bytes read as one number
RESERVED = slice(14, 16)

# Meta is control data; 16 MiB is far beyond any real batch description, yet small enough that a
# corrupt length cannot make a peer buffer gigabytes of JSON.
MAX_META_BYTES = 16 * 1024 * 1024
MAX_U32 = 2**32 - 1
# 2 GiB - 1 by default so lengths stay valid signed 32-bit ints for workers in other languages.
DEFAULT_MAX_PAYLOAD_BYTES = 2**31 - 1
MIN_STATUS = 100
MAX_STATUS = 599
# Joins a packed BATCH entry's header names and values: U+007F (DEL) is in no valid HTTP or gRPC
# header, and JSON writes it as it is (no escape to build or to undo).
PACK_SEP = "\x7f"


class Kind(enum.IntEnum):
    HELLO = 1
    INIT = 2
    READY = 3
    LOAD_FAILED = 4
    BATCH = 5
    RESULT = 6
    BATCH_FAILED = 7
    CANCEL = 8
    CHUNK = 9
    STEP = 10


_KINDS = {kind.value: kind for kind in Kind}
# Read per frame, bound once: on Python 3.11 ``Kind.BATCH`` goes through EnumType.__getattr__,
# ~65 ns a lookup against ~5 ns for a global.
_BATCH, _RESULT = Kind.BATCH, Kind.RESULT


class ProtocolError(Exception):
    """The bytes on a worker channel are not a valid frame, or a frame cannot be put on the wire.

    Either way the channel can no longer be trusted: the owner closes it and fails what was in
    flight, rather than trying to resynchronise on a stream with no frame boundaries left.
    """


# An answer over max_response_size_bytes: the worker sends status 413, no body and this header
# with the real size, so a huge answer never has to fit in a frame; the server makes it its 413.
TOO_LARGE_HEADER = "x-mserve-response-too-large"


# Not frozen: a frozen dataclass sets each field through object.__setattr__, 4x the cost of a
# plain __init__, and these are made per request on both sides of the channel.
@dataclass
class Frame:
    kind: Kind
    meta: dict[str, Any]
    # Decoded frames carry a bytearray (filled in place, never copied again); callers may pass any
    # contiguous bytes-like object so that large bodies need not be copied to be sent.
    payload: bytes | bytearray | memoryview = b""
    # ``meta`` as the JSON text _encode_meta would make of it, where the frame's maker had it
    # for less (result_frame: the C encoder takes ~1.5 us for one small dict). Not compared.
    meta_text: str | None = field(default=None, compare=False, repr=False)


class RequestItem:
    """One request of a batch. ``headers``: ``[name, value]`` pairs; from a packed BATCH entry
    they are split out of their one string only when something reads them (most handlers never
    do). ``op``: what the caller asked the model to do: "" (predict), "explain", or a custom
    operation name. ``api``: the API the request came in through: "" (TorchServe's
    /predictions and friends), "v2" (the Open Inference Protocol) or "v1" (KServe v1); the
    worker reads such bodies as that protocol. ``cached`` (continuous batching): a request still
    generating, sent again for its next step with no body; the handler has its state
    (TorchServe's request "cached in the backend"). A plain class: a dataclass field cannot be
    computed on first read."""

    __slots__ = (
        "_head", "_headers", "api", "body", "cached", "content_type", "op", "params",
        "request_id",
    )  # fmt: skip

    def __init__(
        self,
        request_id: str,
        content_type: str,
        headers: list[list[str]] | None,
        body: bytes | bytearray | memoryview,
        params: dict[str, str] | None = None,
        op: str = "",
        api: str = "",
        head: str = "",
        cached: bool = False,
    ) -> None:
        """``headers`` None: they are ``head``, a packed entry's string (names and values
        joined by PACK_SEP, already checked to pair up)."""
        self.request_id = request_id
        self.content_type = content_type
        self._headers = headers
        self._head = head
        self.body = body
        self.params = {} if params is None else params
        self.op = op
        self.api = api
        self.cached = cached

    @property
    def headers(self) -> list[list[str]]:
        if self._headers is None:
            self._headers = _unpack_headers(self._head) or []
        return self._headers

    @headers.setter
    def headers(self, value: list[list[str]]) -> None:
        self._headers = value

    def last_header_is(self, name: str) -> bool:
        """Whether the last header is ``name`` (exact spelling); a packed entry's string is
        looked at where it ends, not split (the server appends ``traceparent`` last)."""
        if self._headers is not None:
            return bool(self._headers) and self._headers[-1][0] == name
        head = self._head
        end = head.rfind(PACK_SEP)
        start = head.rfind(PACK_SEP, 0, end) + 1
        return end - start == len(name) and head.startswith(name, start)

    def may_have_header(self, lower_name: str) -> bool:
        """False when no header is named ``lower_name`` in any case: a packed entry's string is
        searched, not split; True means look (a value may hold the name too)."""
        if self._headers is not None:
            return True
        return lower_name in self._head.lower()

    def _key(self) -> tuple[Any, ...]:
        return (self.request_id, self.content_type, self.headers, self.body, self.params,
                self.op, self.api, self.cached)  # fmt: skip

    def __eq__(self, other: object) -> bool:
        if type(other) is not RequestItem:
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass was

    def __repr__(self) -> str:
        fields = ("request_id", "content_type", "headers", "body", "params", "op", "api", "cached")
        inner = ", ".join(f"{name}={value!r}" for name, value in zip(fields, self._key()))
        return f"RequestItem({inner})"


# A streamed request whose stream broke after its first chunk (the handler raised, an output could
# not be encoded): its RESULT entry carries this header with the reason, and the server ends the
# response in a way the client can detect instead of sending a last chunk.
STREAM_FAILED_HEADER = "x-mserve-stream-failed"


@dataclass
class ChunkItem:
    """One piece of a streamed response. ``index`` is the request's position in its BATCH frame.
    The first chunk of a request carries its status, content type and headers (``status`` > 0);
    later ones carry only bytes (``status`` 0)."""

    index: int
    body: bytes | bytearray | memoryview
    status: int = 0
    content_type: str = ""
    headers: list[list[str]] = field(default_factory=list)


@dataclass
class ResponseItem:
    status: int
    body: bytes | bytearray | memoryview
    content_type: str = ""
    headers: list[list[str]] = field(default_factory=list)
    # the worker encoded the body as JSON from the handler's value (a RESULT entry's ``json``,
    # sent only while the server logs the model): its inference log embeds it unchecked
    json_body: bool = False


def encode(frame: Frame) -> list[bytes | bytearray | memoryview]:
    """Return the frame as [header + meta, payload] so a large payload is written, never copied.

    The payload element is left out when the payload is empty, so ``writelines`` and ``sendmsg``
    callers need no special case.
    """
    header, meta, payload, size = _parts(frame)
    if not size:
        return [header + meta]
    return [header + meta, payload]


# Below this size a frame goes out as one joined buffer: one write, so the peer wakes once per
# frame instead of once for the header and again for the payload. Above it, the payload is
# written from where it lies, never copied.
JOIN_BELOW_BYTES = 256 * 1024


def encode_for_send(frame: Frame) -> list[bytes | bytearray | memoryview]:
    """``encode`` joined into a single buffer when the frame is small (one copy of each part)."""
    header, meta, payload, size = _parts(frame)
    if size >= JOIN_BELOW_BYTES:
        return [header + meta, payload]
    return [b"".join((header, meta, payload))]


def _parts(frame: Frame) -> tuple[bytes, bytes, bytes | bytearray | memoryview, int]:
    """Header, meta and payload (as given when it is bytes or a bytearray) and its size."""
    kind = frame.kind if type(frame.kind) is Kind else _kind(frame.kind)
    meta = _known_meta(frame.meta_text) if frame.meta_text is not None else None
    if meta is None:
        meta = _encode_meta(kind, frame.meta)
    payload = frame.payload
    if type(payload) is not bytes and type(payload) is not bytearray:
        payload = _byte_view(payload, f"{kind.name} frame payload")
    size = len(payload)
    if size > MAX_U32:
        raise ProtocolError(_too_big("payload_len", size, MAX_U32))
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, 0, len(meta), size), meta, payload, size


def encode_bytes(frame: Frame) -> bytes:
    """One buffer, for tests and for callers whose transport takes a single write."""
    return b"".join(encode(frame))


class Decoder:
    """Turns a byte stream cut at arbitrary points into whole frames.

    Each incoming byte is copied once: header and meta into a small buffer, the payload into a
    bytearray of its own that becomes the frame's payload as it is, so a large payload costs one
    copy and no re-scanning however finely the transport splits it. The payload buffer grows as
    data arrives rather than being allocated from the announced length, so a peer that announces
    2 GiB and sends little costs little, and a big frame never stalls the caller's event loop on
    one huge zero-filled allocation. After a ProtocolError the decoder refuses all further input,
    because the stream has no way to find the next frame boundary.
    """

    def __init__(self, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        if (
            not isinstance(max_payload_bytes, int)
            or isinstance(max_payload_bytes, bool)
            or not 0 <= max_payload_bytes <= MAX_U32
        ):
            raise ValueError(f"max_payload_bytes must be an int in 0..{MAX_U32}")
        self.max_payload_bytes = max_payload_bytes
        self._head = bytearray()  # header, then header + meta, of the frame being read
        self._kind: Kind | None = None
        self._meta_len = 0
        self._payload_len = 0
        self._meta: dict[str, Any] | None = None
        self._payload = bytearray()
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        return len(self._head) + len(self._payload)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._error is not None:
            raise ProtocolError(f"decoder stopped after an earlier error: {self._error}")
        frames: list[Frame] = []
        try:
            if (
                type(data) is memoryview
                and data.ndim == 1
                and data.format == "B"
                and (data.c_contiguous)
            ):  # a recv buffer's view (runtime.Channel): read as it is, no view of our own
                self._consume(data, frames)
            else:
                with memoryview(data) as raw, raw.cast("B") as view:
                    self._consume(view, frames)
        except ProtocolError as exc:
            self._error = exc
            raise
        return frames

    def _consume(self, view: memoryview, frames: list[Frame]) -> None:
        pos, end = 0, len(view)
        while True:
            if self._kind is None and not self._head and end - pos >= HEADER.size:
                pos = self._take_whole(view, pos, end, frames)
                if pos < 0 or pos == end:  # the input ended with that frame, or inside it
                    return
                continue
            if self._meta is None:
                want = HEADER.size if self._kind is None else HEADER.size + self._meta_len
                take = min(want - len(self._head), end - pos)
                self._head += view[pos : pos + take]
                pos += take
                if len(self._head) < want:
                    return
                if self._kind is None:
                    self._read_header(self._head, 0)
                    continue
                self._meta = _decode_meta(self._kind, self._head, HEADER.size, len(self._head))
            take = min(self._payload_len - len(self._payload), end - pos)
            if take:
                self._payload += view[pos : pos + take]
                pos += take
            if len(self._payload) < self._payload_len:
                return
            assert self._kind is not None
            frames.append(Frame(self._kind, self._meta, self._payload))
            self._head = bytearray()
            self._kind, self._meta = None, None
            self._payload = bytearray()

    def _take_whole(self, view: memoryview, pos: int, end: int, frames: list[Frame]) -> int:
        """At a frame boundary with a whole header at ``pos``: read header and meta straight from
        ``view`` (the common case, a frame that arrived in one piece, copies nothing into
        ``_head``). Returns where the next frame starts, or -1 when the rest of ``view`` is held
        as the start of an unfinished frame."""
        magic, version, kind, flags, meta_len, payload_len, reserved = _HEADER_ALL.unpack_from(
            view, pos
        )
        if (  # one test for the usual header; anything else gets its precise error below
            magic != MAGIC
            or version != PROTOCOL_VERSION
            or flags
            or reserved
            or kind not in _KINDS
            or meta_len > MAX_META_BYTES
            or payload_len > self.max_payload_bytes
        ):
            self._read_header(view, pos)  # raises
        kind = _KINDS[kind]
        meta_start = pos + HEADER.size
        meta_end = meta_start + meta_len
        payload_end = meta_end + payload_len
        if payload_end <= end:
            frames.append(
                Frame(
                    kind,
                    _decode_meta(kind, view, meta_start, meta_end),
                    bytearray(view[meta_end:payload_end]),
                )
            )
            return payload_end
        self._kind, self._meta_len, self._payload_len = kind, meta_len, payload_len
        if meta_end > end:  # the meta is cut: hold it where the general path expects it
            self._head = bytearray(view[pos:end])
            return -1
        self._meta = _decode_meta(kind, view, meta_start, meta_end)
        self._head = bytearray(view[pos:meta_end])
        self._payload = bytearray(view[meta_end:end])
        return -1

    def _read_header(self, buf: bytearray | memoryview, pos: int) -> None:
        magic, version, kind, flags, meta_len, payload_len = HEADER.unpack_from(buf, pos)
        if magic != MAGIC:
            raise ProtocolError(
                f"bad frame magic {magic!r}, expected {MAGIC!r}: the peer is not speaking "
                f"the mserve worker protocol"
            )
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"unsupported protocol version {version}, this side speaks {PROTOCOL_VERSION}"
            )
        self._kind = _kind(kind)
        if flags != 0:
            raise ProtocolError(f"frame flags must be 0 (reserved), got 0x{flags:04x}")
        if buf[pos + RESERVED.start] or buf[pos + RESERVED.start + 1]:
            raise ProtocolError(
                f"frame header bytes 14-15 are reserved and must be 0, got "
                f"0x{bytes(buf[pos + RESERVED.start : pos + RESERVED.stop]).hex()}"
            )
        if meta_len > MAX_META_BYTES:
            raise ProtocolError(_too_big("meta_len", meta_len, MAX_META_BYTES))
        if payload_len > self.max_payload_bytes:
            raise ProtocolError(_too_big("payload_len", payload_len, self.max_payload_bytes))
        self._meta_len = meta_len
        self._payload_len = payload_len


def batch_frame(batch_id: int, items: Sequence[RequestItem], *, check: bool = True) -> Frame:
    """Build a BATCH frame; fields are checked here so a bad item fails in the server, not later
    in a worker far from its cause. ``check=False`` is for the server's hot path, whose items
    come straight from the HTTP layer (all strings by construction)."""
    if not check:
        entries = [_entry(item, len(item.body)) for item in items]
        texts = [_packed_text(e) if type(e) is list else None for e in entries]
        return Frame(
            _BATCH,
            {"batch_id": batch_id, "requests": entries},
            items[0].body if len(items) == 1 else b"".join(item.body for item in items),
            None  # an object entry: the encoder writes the meta
            if None in texts
            else f'{{"batch_id":{batch_id},"requests":[{",".join(texts)}]}}',  # type: ignore[arg-type]
        )
    _check_uint(batch_id, "BATCH batch_id")
    entries = []
    bodies = []
    for i, item in enumerate(items):
        where = f"BATCH requests[{i}]"
        body = _byte_view(item.body, f"{where}.body")
        checked = RequestItem(
            request_id=_check_str(item.request_id, f"{where}.request_id"),
            content_type=_check_str(item.content_type, f"{where}.content_type"),
            headers=_check_pairs(item.headers, f"{where}.headers"),
            body=body,
            params=_check_params(item.params, f"{where}.params"),
            op=_check_str(item.op, f"{where}.op"),
            api=_check_str(item.api, f"{where}.api"),
            cached=_check_bool(item.cached, f"{where}.cached"),
        )
        entries.append(_entry(checked, len(body)))
        bodies.append(body)
    return Frame(Kind.BATCH, {"batch_id": batch_id, "requests": entries}, b"".join(bodies))


_flat = itertools.chain.from_iterable


def _entry(item: RequestItem, size: int) -> dict[str, Any] | list[Any]:
    """A request's BATCH entry: packed, ``[id, content_type, size, headers]`` with the headers
    as one string, for the usual request (predict on TorchServe's paths, no query); else the
    object with every field. Packed, a request with 6 headers decodes with 4 JSON strings
    instead of 17 and 6 lists (docs/protocol.md, Batch and result layout)."""
    if not item.params and not item.op and not item.api and not item.cached:
        headers = item.headers
        head = PACK_SEP.join(_flat(headers))
        if head.count(PACK_SEP) == 2 * len(headers) - 1 or not headers:
            return [item.request_id, item.content_type, size, head]
    entry = {
        "id": item.request_id,
        "content_type": item.content_type,
        "headers": item.headers,
        "params": item.params,
        "size": size,
    }
    if item.op:  # absent means predict, which keeps the common frame small
        entry["op"] = item.op
    if item.api:
        entry["api"] = item.api
    if item.cached:  # absent means a new request
        entry["cached"] = True
    return entry


def parse_batch(frame: Frame) -> tuple[int, list[RequestItem]]:
    """Bodies come back as memoryview slices of the payload, so a batch of large inputs is never
    copied again inside the worker."""
    fast = _fast_split(frame, _BATCH, "requests")
    if fast is not None:
        batch_id, entries, bodies = fast
        items = []
        for entry, body in zip(entries, bodies):
            if type(entry) is list:  # packed (_fast_split checked its shape and size)
                request_id, content_type, _, head = entry
                if (
                    type(request_id) is not str
                    or type(content_type) is not str
                    or type(head) is not str
                    or head.count(PACK_SEP) % 2 == 0 < len(head)
                ):
                    return _parse_batch_checked(frame)
                items.append(RequestItem(request_id, content_type, None, body, {}, "", "", head))
                continue
            request_id = entry.get("id")
            content_type = entry.get("content_type", "")
            headers = entry.get("headers", [])
            params = entry.get("params", {})
            op = entry.get("op", "")
            api = entry.get("api", "")
            cached = entry.get("cached", False)
            if (
                type(request_id) is not str
                or type(cached) is not bool
                or type(content_type) is not str
                or type(op) is not str
                or type(api) is not str
                or not _pairs_ok(headers)
                or type(params) is not dict
                or (
                    params and not all(type(k) is str and type(v) is str for k, v in params.items())
                )
            ):
                return _parse_batch_checked(frame)
            items.append(
                RequestItem(request_id, content_type, headers, body, params, op, api, "", cached)
            )
        return batch_id, items
    return _parse_batch_checked(frame)


def _parse_batch_checked(frame: Frame) -> tuple[int, list[RequestItem]]:
    """The slow path: every field checked, with a message that names the bad one."""
    batch_id, entries, bodies = _split(frame, Kind.BATCH, "requests")
    items = []
    for i, entry in enumerate(entries):
        where = f"BATCH requests[{i}]"
        if type(entry) is list:  # packed: _split checked its length and size
            head = _check_str(entry[3], f"{where}[3] (headers)")
            headers = _unpack_headers(head)
            if headers is None:
                raise ProtocolError(
                    f"{where}[3] (headers) must hold names and values joined by U+007F,"
                    f" an even number of them; got {head.count(PACK_SEP) + 1}"
                )
            items.append(
                RequestItem(
                    _check_str(entry[0], f"{where}[0] (id)"),
                    _check_str(entry[1], f"{where}[1] (content_type)"),
                    headers,
                    bodies[i],
                )
            )
            continue
        items.append(
            RequestItem(
                request_id=_check_str(_required(entry, "id", where), f"{where}.id"),
                content_type=_check_str(entry.get("content_type", ""), f"{where}.content_type"),
                headers=_check_pairs(entry.get("headers", []), f"{where}.headers"),
                body=bodies[i],
                params=_check_params(entry.get("params", {}), f"{where}.params"),
                op=_check_str(entry.get("op", ""), f"{where}.op"),
                api=_check_str(entry.get("api", ""), f"{where}.api"),
                cached=_check_bool(entry.get("cached", False), f"{where}.cached"),
            )
        )
    return batch_id, items


def _packed_text(entry: list[Any]) -> str:
    """A packed entry's JSON, as the meta encoder writes it (tested byte for byte): three
    strings and a size straight into the text cost less than the encoder's walk of them."""
    return f"[{_quote(entry[0])},{_quote(entry[1])},{entry[2]},{_quote(entry[3])}]"


def _unpack_headers(head: object) -> list[list[str]] | None:
    """A packed entry's headers as ``[name, value]`` pairs; None when they do not pair up."""
    if type(head) is not str:
        return None
    if not head:
        return []
    flat = head.split(PACK_SEP)
    if len(flat) % 2:
        return None
    pairs = iter(flat)
    return list(map(list, zip(pairs, pairs)))


def cancel_frame(batch_id: int, request_ids: Sequence[str]) -> Frame:
    """Requests of a batch sent but not yet started whose callers went away: the worker answers
    them without running the handler (their answers reach nobody)."""
    _check_uint(batch_id, "CANCEL batch_id")
    return Frame(
        Kind.CANCEL,
        {"batch_id": batch_id, "ids": [_check_str(r, "CANCEL ids[]") for r in request_ids]},
    )


def parse_cancel(frame: Frame) -> tuple[int, list[str]]:
    if frame.kind != Kind.CANCEL:
        raise ProtocolError(f"expected a CANCEL frame, got {frame.kind.name}")
    batch_id = _check_uint(_required(frame.meta, "batch_id", "CANCEL"), "CANCEL batch_id")
    ids = frame.meta.get("ids", [])
    if type(ids) is not list:
        raise ProtocolError("CANCEL ids must be a list of strings")
    return batch_id, [_check_str(r, "CANCEL ids[]") for r in ids]


_JSON_FLAG = ',"json":true'  # a RESULT entry whose body the worker encoded as JSON


def result_frame(
    batch_id: int,
    items: Sequence[ResponseItem],
    *,
    handler_ms: float | None = None,
    metrics: Sequence[dict[str, Any]] | None = None,
    phases: Sequence[Sequence[Any]] | None = None,
    inference_log: Sequence[Sequence[Any]] | None = None,
) -> Frame:
    """``handler_ms``: how long the handler took on the batch; ``metrics``: what it recorded
    through ``context.metrics`` (the key is left out when there is nothing); ``phases``: a
    traced batch's handler phases, ``[name, start_ms, duration_ms]`` from the handler call's
    start (the server makes spans of them); ``inference_log``: ``[request id, record]`` pairs a v2
    model class chose to log (left out when there is nothing)."""
    _check_uint(batch_id, "RESULT batch_id")
    entries = []
    # each entry's JSON, while every entry is the usual one
    texts: list[str] | None = [] if type(batch_id) is int else None
    bodies: list[bytes | memoryview] = []
    for i, item in enumerate(items):
        status, body = item.status, item.body
        content_type, headers = item.content_type, item.headers
        if (  # the usual item: exactly the wire types, nothing to convert or to explain
            type(status) is int
            and MIN_STATUS <= status <= MAX_STATUS
            and type(content_type) is str
            and type(body) is bytes
            and (headers == [] or _pairs_ok(headers))
        ):
            size = len(body)
            entry = {"status": status, "content_type": content_type, "headers": headers,
                     "size": size}  # fmt: skip
            if item.json_body is True:
                entry["json"] = True
            entries.append(entry)
            if texts is not None:
                texts.append(
                    f'{{"status":{status},"content_type":{_quote(content_type)},'
                    f'"headers":{_pairs_text(headers)},"size":{size}'
                    f"{_JSON_FLAG if item.json_body is True else ''}}}"
                )
            bodies.append(body)  # a lone bytes body becomes the payload as it is, by b"".join
            continue
        entry, body = checked_response(item, f"RESULT responses[{i}]")
        if item.json_body is True:
            entry["json"] = True
        entries.append(entry)
        bodies.append(body)
        texts = None
    meta: dict[str, Any] = {"batch_id": batch_id, "responses": entries}
    if handler_ms is not None:
        meta["handler_ms"] = handler_ms
    if metrics:
        meta["metrics"] = list(metrics)
        texts = None
    if phases:
        meta["phases"] = [list(p) for p in phases]
    if inference_log:
        meta["inference_log"] = list(inference_log)
        texts = None
    text = None
    if texts is not None and (
        handler_ms is None or (type(handler_ms) is float and handler_ms - handler_ms == 0.0)
    ):  # float('inf') - itself is NaN: the checked path refuses what is not JSON
        timing = "" if handler_ms is None else f',"handler_ms":{handler_ms!r}'
        text = f'{{"batch_id":{batch_id},"responses":[{",".join(texts)}]{timing}}}'
    return Frame(_RESULT, meta, b"".join(bodies), text)


def _pairs_text(pairs: list[list[str]]) -> str:
    """Checked ``[name, value]`` pairs as JSON; one pair (a streamed step's marker, a sequence
    id) by hand, cheaper than the encoder's call."""
    if not pairs:
        return "[]"
    if len(pairs) == 1:
        name, value = pairs[0]
        return f"[[{_quote(name)},{_quote(value)}]]"
    return _encode_json(pairs)


def checked_response(item: ResponseItem, where: str) -> tuple[dict[str, Any], memoryview]:
    """``item``'s RESULT entry and its body, every field checked against what the wire carries;
    a ProtocolError names the bad field. In-process callers (a Ray replica) hand the same
    answers on without a frame, and check them by the same rules."""
    body = _byte_view(item.body, f"{where}.body")
    entry = {
        "status": _check_status(item.status, f"{where}.status"),
        "content_type": _check_str(item.content_type, f"{where}.content_type"),
        "headers": _check_pairs(item.headers, f"{where}.headers"),
        "size": len(body),
    }
    return entry, body


def parse_result(frame: Frame, kind: Kind = _RESULT) -> tuple[int, list[ResponseItem]]:
    """A RESULT frame's batch id and responses (``kind`` STEP: a step's, see parse_step)."""
    fast = _fast_split(frame, kind, "responses")
    if fast is not None:
        batch_id, entries, bodies = fast
        items = []
        for entry, body in zip(entries, bodies):
            status = entry.get("status")
            content_type = entry.get("content_type", "")
            headers = entry.get("headers", [])
            if (
                type(status) is not int
                or not MIN_STATUS <= status <= MAX_STATUS
                or type(content_type) is not str
                or not _pairs_ok(headers)
            ):
                return _parse_result_checked(frame, kind)
            items.append(
                ResponseItem(status, body, content_type, headers, entry.get("json") is True)
            )
        return batch_id, items
    return _parse_result_checked(frame, kind)


# What a handler's metric entry says it is (context.metrics' add_* method), and the metric
# types TorchServe's metrics.yaml and MetricTypes name.
METRIC_KINDS = ("counter", "time", "size", "percent", "metric")
METRIC_TYPES = ("counter", "gauge", "histogram")


@dataclass(frozen=True)
class MetricEntry:
    """One value a handler recorded through ``context.metrics``, as a RESULT frame carries it."""

    name: str
    value: float
    unit: str
    kind: str
    request_id: str | None
    dimensions: list[list[str]]
    type: str | None = None  # overrides the type the kind implies


def parse_result_metrics(frame: Frame) -> tuple[float | None, list[MetricEntry]]:
    """A RESULT's ``handler_ms`` (None when absent) and its handler metric entries."""
    meta = frame.meta
    handler_ms = meta.get("handler_ms")
    if handler_ms is not None and (
        type(handler_ms) not in (int, float) or not 0 <= handler_ms < float("inf")
    ):
        raise ProtocolError(f"RESULT handler_ms must be a number >= 0, got {handler_ms!r}")
    raw = meta.get("metrics")
    if raw is None:
        return handler_ms, []
    if type(raw) is not list:
        raise ProtocolError(f"RESULT metrics must be a list, got {type(raw).__name__}")
    entries = []
    for i, entry in enumerate(raw):
        where = f"RESULT metrics[{i}]"
        if type(entry) is not dict:
            raise ProtocolError(f"{where} must be an object, got {type(entry).__name__}")
        name = _check_str(_required(entry, "name", where), f"{where}.name")
        value = _required(entry, "value", where)
        if type(value) not in (int, float) or value != value:
            raise ProtocolError(f"{where}.value must be a number, got {value!r}")
        kind = entry.get("kind", "metric")
        if kind not in METRIC_KINDS:
            raise ProtocolError(f"{where}.kind must be one of {METRIC_KINDS}, got {kind!r}")
        metric_type = entry.get("type")
        if metric_type is not None and metric_type not in METRIC_TYPES:
            raise ProtocolError(f"{where}.type must be one of {METRIC_TYPES}, got {metric_type!r}")
        request_id = entry.get("request_id")
        if request_id is not None:
            _check_str(request_id, f"{where}.request_id")
        entries.append(
            MetricEntry(
                name=name,
                value=value,
                unit=_check_str(entry.get("unit", ""), f"{where}.unit"),
                kind=kind,
                request_id=request_id,
                dimensions=_check_pairs(entry.get("dimensions", []), f"{where}.dimensions"),
                type=metric_type,
            )
        )
    return handler_ms, entries


def _parse_result_checked(frame: Frame, kind: Kind = Kind.RESULT) -> tuple[int, list[ResponseItem]]:
    batch_id, entries, bodies = _split(frame, kind, "responses")
    items = []
    for i, entry in enumerate(entries):
        where = f"{kind.name} responses[{i}]"
        items.append(
            ResponseItem(
                status=_check_status(_required(entry, "status", where), f"{where}.status"),
                body=bodies[i],
                content_type=_check_str(entry.get("content_type", ""), f"{where}.content_type"),
                headers=_check_pairs(entry.get("headers", []), f"{where}.headers"),
                json_body=entry.get("json") is True,
            )
        )
    return batch_id, items


def chunk_frame(batch_id: int, items: Sequence[ChunkItem]) -> Frame:
    """Chunks of requests of the running batch, sent before its RESULT (which closes them)."""
    _check_uint(batch_id, "CHUNK batch_id")
    entries: list[dict[str, Any]] = []
    bodies: list[bytes | memoryview] = []
    for i, item in enumerate(items):
        where = f"CHUNK chunks[{i}]"
        body = item.body if type(item.body) is bytes else _byte_view(item.body, f"{where}.body")
        entry: dict[str, Any] = {"i": _check_uint(item.index, f"{where}.index"), "size": len(body)}
        if item.status:  # the first chunk of its request: the response's head comes with it
            entry["status"] = _check_status(item.status, f"{where}.status")
            entry["content_type"] = _check_str(item.content_type, f"{where}.content_type")
            entry["headers"] = _check_pairs(item.headers, f"{where}.headers")
        entries.append(entry)
        bodies.append(body)
    return Frame(Kind.CHUNK, {"batch_id": batch_id, "chunks": entries}, b"".join(bodies))


def parse_chunk(frame: Frame) -> tuple[int, list[ChunkItem]]:
    batch_id, entries, bodies = _split(frame, Kind.CHUNK, "chunks")
    items = []
    for i, entry in enumerate(entries):
        where = f"CHUNK chunks[{i}]"
        index = _check_uint(_required(entry, "i", where), f"{where}.i")
        if "status" not in entry:
            items.append(ChunkItem(index, bodies[i]))
            continue
        items.append(
            ChunkItem(
                index,
                bodies[i],
                _check_status(entry["status"], f"{where}.status"),
                _check_str(entry.get("content_type", ""), f"{where}.content_type"),
                _check_pairs(entry.get("headers", []), f"{where}.headers"),
            )
        )
    return batch_id, items


def _kind(value: object) -> Kind:
    if type(value) is Kind:
        return value
    if type(value) is int and value in _KINDS:  # a header byte: no Enum lookup machinery
        return _KINDS[value]
    try:
        return Kind(value)  # type: ignore[arg-type]
    except ValueError:
        known = ", ".join(f"{k.value} ({k.name})" for k in Kind)
        raise ProtocolError(f"unknown frame kind {value!r}, expected one of {known}") from None


def _too_big(name: str, value: int, limit: int) -> str:
    return f"frame {name} {value} bytes exceeds the limit of {limit} bytes"


def _known_meta(text: str) -> bytes | None:
    """A frame's ready meta text as bytes; None (encode its meta instead) where it holds what
    UTF-8 cannot carry (lone surrogates: _encode_meta escapes them) or is too large."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return data if len(data) <= MAX_META_BYTES else None


def _encode_meta(kind: Kind, meta: object) -> bytes:
    if not isinstance(meta, dict):
        raise ProtocolError(
            f"{kind.name} frame meta must be a dict (a JSON object), got {type(meta).__name__}"
        )
    try:
        text = _encode_json(meta)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"{kind.name} frame meta is not JSON-serialisable: {exc}") from exc
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        # Lone surrogates are how Python carries undecodable bytes (e.g. a raw header byte);
        # \u escapes are plain ASCII on the wire and bring the same string back on the other side.
        data = json.dumps(meta, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    if len(data) > MAX_META_BYTES:
        raise ProtocolError(_too_big("meta_len", len(data), MAX_META_BYTES))
    return data


def _reject_constant(name: str) -> None:
    raise ProtocolError(f"frame meta contains {name}, which is not valid JSON")


# One codec each, built once: json.dumps/json.loads with options build a new one per call,
# which costs more than encoding a small meta.
_META_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_META_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_META_SCAN = _META_DECODER.scan_once
_quote = json.encoder.encode_basestring  # a JSON string, as _META_ENCODER writes one


def json_encoder(encoder: json.JSONEncoder, check_circular: bool = True) -> Callable[[object], str]:
    """``encoder.encode``, less what it redoes per call: JSONEncoder builds CPython's C encoder
    (and a closure) in Python on every call, about a third of encoding a BATCH meta (~14,000 of
    ~45,000 instructions, callgrind) and more of a handler's small answer. Here the C encoder is
    made with the arguments JSONEncoder passes it: once, when ``check_circular`` is off (a cycle
    then ends in RecursionError), else with a fresh ``markers`` dict per call, as JSONEncoder
    does, so a cycle still fails as "Circular reference detected". Without the C encoder
    (other Pythons) or with ``indent``: the plain call."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None or encoder.indent is not None:
        return encoder.encode
    quote = (
        json.encoder.encode_basestring_ascii
        if encoder.ensure_ascii
        else json.encoder.encode_basestring
    )
    args = (encoder.default, quote, None, encoder.key_separator, encoder.item_separator,
            encoder.sort_keys, encoder.skipkeys, encoder.allow_nan)  # fmt: skip
    if not check_circular:
        once = make(None, *args)
        return lambda value: "".join(once(value, 0))
    return lambda value: "".join(make({}, *args)(value, 0))


_encode_json = json_encoder(_META_ENCODER, check_circular=False)


def _decode_meta(kind: Kind, buf: bytearray | memoryview, start: int, stop: int) -> dict[str, Any]:
    try:
        text = str(buf[start:stop], "utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"{kind.name} frame meta is not valid UTF-8: {exc}") from None
    try:
        if text.startswith("\ufeff"):  # json.loads refuses a BOM too; the decoder alone would not
            raise ValueError("Unexpected UTF-8 BOM (decode using utf-8-sig)")
        try:  # a meta with no space around it, as ours are: decode() skips it with two regexes,
            meta, end = _META_SCAN(text, 0)  # and raw_decode() wraps this call in Python
        except (ValueError, StopIteration):
            end = -1
        if end != len(text):
            meta = _META_DECODER.decode(text)  # what surrounds it, or the precise error
    except ValueError as exc:
        raise ProtocolError(f"{kind.name} frame meta is not valid JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError(f"{kind.name} frame meta nests too deeply to decode") from None
    if not isinstance(meta, dict):
        raise ProtocolError(
            f"{kind.name} frame meta must be a JSON object, got a JSON {_json_type(meta)}"
        )
    return meta


def _json_type(value: object) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return names.get(type(value), "null")


def _byte_view(obj: object, what: str) -> memoryview:
    if type(obj) is bytes:  # the common case, nothing to check
        return memoryview(obj)
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise ProtocolError(f"{what} must be bytes-like, got {type(obj).__name__}") from None
    if not view.c_contiguous:
        raise ProtocolError(f"{what} must be a contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _pairs_ok(value: object) -> bool:
    """Whether ``value`` is a list of [str, str] lists, the wire shape of headers. A plain
    loop: a generator under ``all()`` cost twice as much per request (timeit, 4 headers)."""
    if type(value) is not list:
        return False
    for p in value:
        if type(p) is not list or len(p) != 2 or type(p[0]) is not str or type(p[1]) is not str:
            return False
    return True


def _fast_split(
    frame: Frame, kind: Kind, key: str
) -> tuple[int, list[dict[str, Any]], list[memoryview]] | None:
    """``_split`` for well-formed frames, building no error text; None sends the caller to the
    checked path, which raises the precise error (or accepts an unusual but valid frame)."""
    if frame.kind is not kind:
        return None
    meta = frame.meta
    batch_id = meta.get("batch_id")
    entries = meta.get(key)
    payload = frame.payload
    if (
        type(batch_id) is not int
        or batch_id < 0
        or type(entries) is not list
        or type(payload) not in (bytes, bytearray)
    ):
        return None
    view = memoryview(payload)
    whole = len(view)
    bodies = []
    offset = 0
    for entry in entries:
        if type(entry) is dict:
            size = entry.get("size")
        elif type(entry) is list and len(entry) == 4 and kind is _BATCH:  # packed
            size = entry[2]
        else:
            return None
        if type(size) is not int or size < 0:
            return None
        # a lone body is the whole payload: the view itself, not a slice of it
        bodies.append(view if size == whole and not offset else view[offset : offset + size])
        offset += size
    if offset != whole:
        return None
    return batch_id, entries, bodies


def _split(
    frame: Frame, kind: Kind, key: str
) -> tuple[int, list[dict[str, Any]], list[memoryview]]:
    """Check the meta that batch and result frames share and cut the payload into bodies."""
    if frame.kind != kind:
        raise ProtocolError(f"expected a {kind.name} frame, got {_kind(frame.kind).name}")
    meta = frame.meta
    batch_id = _check_uint(
        _required(meta, "batch_id", f"{kind.name} meta"), f"{kind.name} batch_id"
    )
    entries = _required(meta, key, f"{kind.name} meta")
    packed = kind is Kind.BATCH  # its entries may be packed arrays (_entry)
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) or (packed and type(e) is list) for e in entries
    ):
        raise ProtocolError(
            f"{kind.name} meta {key!r} must be a list of objects"
            + (" or packed arrays" if packed else "")
        )
    sizes = []
    for i, entry in enumerate(entries):
        where = f"{kind.name} {key}[{i}]"
        if type(entry) is list:
            if len(entry) != 4:
                raise ProtocolError(
                    f"{where} is packed: [id, content_type, size, headers], 4 items,"
                    f" got {len(entry)}"
                )
            sizes.append(_check_uint(entry[2], f"{where}[2] (size)"))
        else:
            sizes.append(_check_uint(_required(entry, "size", where), f"{where}.size"))
    view = _byte_view(frame.payload, f"{kind.name} frame payload")
    if sum(sizes) != len(view):
        raise ProtocolError(
            f"{kind.name} {batch_id}: {key} sizes add up to {sum(sizes)} bytes but the payload "
            f"holds {len(view)} bytes"
        )
    bodies = []
    offset = 0
    for size in sizes:
        bodies.append(view[offset : offset + size])
        offset += size
    return batch_id, entries, bodies


def _required(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise ProtocolError(f"{where} lacks the required field {key!r}")
    return obj[key]


def _check_uint(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"{where} must be a non-negative integer, got {value!r}")
    return value


def _check_bool(value: object, where: str) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"{where} must be true or false, got {value!r}")
    return value


def _check_status(value: object, where: str) -> int:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not MIN_STATUS <= value <= MAX_STATUS
    ):
        raise ProtocolError(
            f"{where} must be an HTTP status in {MIN_STATUS}..{MAX_STATUS}, got {value!r}"
        )
    return value


def _check_str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{where} must be a string, got {type(value).__name__}")
    return value


def _check_pairs(value: object, where: str) -> list[list[str]]:
    if _pairs_ok(value):
        return value  # type: ignore[return-value]  # already exactly the wire shape
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(f"{where} must be a list of [name, value] pairs")
    pairs = []
    for i, pair in enumerate(value):
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not all(isinstance(part, str) for part in pair)
        ):
            raise ProtocolError(
                f"{where}[{i}] must be a [name, value] pair of strings, got {pair!r}"
            )
        pairs.append([pair[0], pair[1]])
    return pairs


def _check_params(value: object, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ProtocolError(f"{where} must be an object mapping names to string values")
    return value


# Continuous batching run by the worker (docs/protocol.md, Continuous batching) ---------------


def step_frame(step_id: int, members: Sequence[Sequence[int]], reply: Frame) -> Frame:
    """One step of a worker's continuous-batching loop: ``reply`` (the step's RESULT frame, or
    BATCH_FAILED when the handler call failed as a whole) with ``members``, the
    ``[batch_id, index]`` of each request of the step in order: the BATCH frame that brought it
    and its place there. A request whose answer carries ``ts_stream_next: true`` goes on."""
    _check_uint(step_id, "STEP step")
    meta = dict(reply.meta)
    meta["batch_id"] = step_id
    pairs = meta["members"] = [[int(b), int(i)] for b, i in members]
    text = None
    if reply.kind is not _RESULT:
        meta["failed"] = True
    elif reply.meta_text is not None and reply.meta["batch_id"] == step_id:
        # the RESULT's own text with the members added: no second encoding of the answers
        listed = ",".join(f"[{b},{i}]" for b, i in pairs)
        text = f'{reply.meta_text[:-1]},"members":[{listed}]}}'
    return Frame(Kind.STEP, meta, reply.payload, text)


def parse_step(frame: Frame) -> tuple[list[tuple[int, int]], list[ResponseItem] | None]:
    """A STEP frame's members and their answers, or None for the answers of a failed step (its
    ``error`` and ``traceback`` are in ``frame.meta``)."""
    pairs = _members(frame)
    if frame.meta.get("failed") is True:
        _check_str(_required(frame.meta, "error", "STEP meta"), "STEP error")
        return pairs, None
    _, responses = parse_result(frame, Kind.STEP)
    if len(responses) != len(pairs):
        raise ProtocolError(f"STEP has {len(pairs)} members but {len(responses)} responses")
    return pairs, responses


def parse_step_chunk(frame: Frame) -> tuple[list[tuple[int, int]], list[ChunkItem]]:
    """A CHUNK frame sent in the middle of a step (``send_intermediate_predict_response``): the
    step's members, and chunks whose ``index`` is a place among them."""
    pairs = _members(frame)
    _, chunks = parse_chunk(frame)
    for chunk in chunks:
        if chunk.index >= len(pairs):
            raise ProtocolError(
                f"CHUNK for request {chunk.index} of a step of {len(pairs)} requests"
            )
    return pairs, chunks


def _members(frame: Frame) -> list[tuple[int, int]]:
    members = frame.meta.get("members")
    if type(members) is not list or not all(
        type(m) is list and len(m) == 2 and all(type(n) is int and n >= 0 for n in m)
        for m in members
    ):
        raise ProtocolError(
            f"{_kind(frame.kind).name} members must be a list of [batch_id, index] pairs"
        )
    return [(m[0], m[1]) for m in members]
