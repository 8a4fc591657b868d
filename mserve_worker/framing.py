"""The worker protocol's frame layer: the frame kinds, the 16-byte header, encoding a frame for
the wire, the incremental decoder, and the JSON codec of each frame's meta.

Sans-IO on purpose: both sides own their own transport (asyncio streams in the server, a blocking
socket in the worker), and a codec that only turns bytes into frames can be tested byte for byte
and reused by a worker written in another language. Standard library only, Python 3.8. The wire
format is described in ``docs/protocol.md``; keep the two in step. Callers import it through
:mod:`.protocol`.
"""

from __future__ import annotations

import enum
import json
import json.encoder
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# 2: CANCEL, for batches pipelined behind a running one; 3: CHUNK; 4: packed BATCH entries;
# 5: STEP; 6: RELOAD and RELOADED (hot reload of the handler's code)
PROTOCOL_VERSION = 6
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
    RELOAD = 11
    RELOADED = 12
    STARTED = 13
    PARK = 14
    PARKED = 15


_KINDS = {kind.value: kind for kind in Kind}
# Read per frame, bound once: on Python 3.11 ``Kind.BATCH`` goes through EnumType.__getattr__,
# ~65 ns a lookup against ~5 ns for a global.
_BATCH, _RESULT = Kind.BATCH, Kind.RESULT


class ProtocolError(Exception):
    """The bytes on a worker channel are not a valid frame, or a frame cannot be put on the wire.

    Either way the channel can no longer be trusted: the owner closes it and fails what was in
    flight, rather than trying to resynchronise on a stream with no frame boundaries left.
    """


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
            ):  # a recv buffer's view (channel.Channel): read as it is, no view of our own
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
