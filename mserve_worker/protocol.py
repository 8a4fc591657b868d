"""The frame codec spoken between the server and its worker processes.

Sans-IO on purpose: both sides own their own transport (asyncio streams in the server, a blocking
socket in the worker), and a codec that only turns bytes into frames can be tested byte for byte
and reused by a worker written in another language. It runs inside every model's environment, so
it imports the standard library only and keeps to Python 3.8. The wire format is described in
``docs/protocol.md``; keep the two in step.

The requests (BATCH and CANCEL frames) are here; the frame layer is :mod:`.framing`, the answers
:mod:`.answers`, what their frames share :mod:`.entries`, the hot reload's two frames
:mod:`.reload_frames` and the parked workers' two :mod:`.park_frames`. Everyone imports the
protocol from here: this module re-exports the others' public names.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from .answers import (
    METRIC_KINDS,
    METRIC_TYPES,
    STREAM_FAILED_HEADER,
    TOO_LARGE_HEADER,
    ChunkItem,
    MetricEntry,
    ResponseItem,
    checked_response,
    chunk_frame,
    parse_chunk,
    parse_result,
    parse_result_metrics,
    parse_step,
    parse_step_chunk,
    result_frame,
    step_frame,
)
from .entries import (
    MAX_STATUS,
    MIN_STATUS,
    _check_bool,
    _check_pairs,
    _check_params,
    _check_str,
    _check_uint,
    _fast_split,
    _pairs_ok,
    _required,
    _split,
)
from .framing import (
    _BATCH,
    DEFAULT_MAX_PAYLOAD_BYTES,
    HEADER,
    JOIN_BELOW_BYTES,
    MAGIC,
    MAX_META_BYTES,
    MAX_U32,
    PROTOCOL_VERSION,
    RESERVED,
    Decoder,
    Frame,
    Kind,
    ProtocolError,
    _byte_view,
    _quote,
    encode,
    encode_bytes,
    encode_for_send,
    json_encoder,
)
from .park_frames import (
    Parked,
    park_frame,
    parked_frame,
    parse_park,
    parse_parked,
)
from .reload_frames import (
    ABORT,
    COMMIT,
    PREPARE,
    RELOAD_STEPS,
    Reloaded,
    parse_reload,
    parse_reloaded,
    reload_frame,
    reloaded_frame,
)

# Joins a packed BATCH entry's header names and values: U+007F (DEL) is in no valid HTTP or gRPC
# header, and JSON writes it as it is (no escape to build or to undo).
PACK_SEP = "\x7f"

# the protocol's whole public surface, wherever each part lives
__all__ = [
    "ABORT",
    "COMMIT",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "HEADER",
    "JOIN_BELOW_BYTES",
    "MAGIC",
    "MAX_META_BYTES",
    "MAX_STATUS",
    "MAX_U32",
    "METRIC_KINDS",
    "METRIC_TYPES",
    "MIN_STATUS",
    "PACK_SEP",
    "PREPARE",
    "PROTOCOL_VERSION",
    "RELOAD_STEPS",
    "RESERVED",
    "STREAM_FAILED_HEADER",
    "TOO_LARGE_HEADER",
    "ChunkItem",
    "Decoder",
    "Frame",
    "Kind",
    "MetricEntry",
    "Parked",
    "ProtocolError",
    "Reloaded",
    "RequestItem",
    "ResponseItem",
    "batch_frame",
    "cancel_frame",
    "checked_response",
    "chunk_frame",
    "encode",
    "encode_bytes",
    "encode_for_send",
    "json_encoder",
    "park_frame",
    "parked_frame",
    "parse_batch",
    "parse_cancel",
    "parse_chunk",
    "parse_park",
    "parse_parked",
    "parse_reload",
    "parse_reloaded",
    "parse_result",
    "parse_result_metrics",
    "parse_step",
    "parse_step_chunk",
    "reload_frame",
    "reloaded_frame",
    "result_frame",
    "started_frame",
    "step_frame",
]


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


def batch_frame(
    batch_id: int, items: Sequence[RequestItem], *, check: bool = True, ahead: bool = False
) -> Frame:
    """Build a BATCH frame; fields are checked here so a bad item fails in the server, not later
    in a worker far from its cause. ``check=False`` is for the server's hot path, whose items
    come straight from the HTTP layer (all strings by construction). ``ahead``: the worker runs
    it before the batches it holds that have not started (see :mod:`.channel`)."""
    if not check:
        entries = [_entry(item, len(item.body)) for item in items]
        texts = [_packed_text(e) if type(e) is list else None for e in entries]
        meta: dict[str, Any] = {"batch_id": batch_id, "requests": entries}
        if ahead:
            meta["ahead"] = True
        return Frame(
            _BATCH,
            meta,
            items[0].body if len(items) == 1 else b"".join(item.body for item in items),
            None  # an object entry (or a batch sent ahead): the encoder writes the meta
            if ahead or None in texts
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
    meta = {"batch_id": batch_id, "requests": entries}
    if ahead:
        meta["ahead"] = True
    return Frame(Kind.BATCH, meta, b"".join(bodies))


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


def started_frame(batch_id: int) -> Frame:
    """The worker runs batch ``batch_id`` now, before batches sent earlier that it had not
    started (it was sent ``ahead``): the server keeps its batches in the order they run."""
    _check_uint(batch_id, "STARTED batch_id")
    return Frame(Kind.STARTED, {"batch_id": batch_id})


def parse_cancel(frame: Frame) -> tuple[int, list[str]]:
    if frame.kind != Kind.CANCEL:
        raise ProtocolError(f"expected a CANCEL frame, got {frame.kind.name}")
    batch_id = _check_uint(_required(frame.meta, "batch_id", "CANCEL"), "CANCEL batch_id")
    ids = frame.meta.get("ids", [])
    if type(ids) is not list:
        raise ProtocolError("CANCEL ids must be a list of strings")
    return batch_id, [_check_str(r, "CANCEL ids[]") for r in ids]
