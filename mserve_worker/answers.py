"""The worker's answers: RESULT frames (each request's status, content type, headers and body,
the handler's time, metrics and phases), CHUNK frames of a streamed answer, and STEP frames of a
continuous-batching loop run by the worker (docs/protocol.md). Standard library only, Python
3.8; callers import them through :mod:`.protocol`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .entries import (
    MAX_STATUS,
    MIN_STATUS,
    _check_pairs,
    _check_status,
    _check_str,
    _check_uint,
    _fast_split,
    _pairs_ok,
    _required,
    _split,
)
from .framing import (
    _RESULT,
    Frame,
    Kind,
    ProtocolError,
    _byte_view,
    _encode_json,
    _kind,
    _quote,
)

# An answer over max_response_size_bytes: the worker sends status 413, no body and this header
# with the real size, so a huge answer never has to fit in a frame; the server makes it its 413.
TOO_LARGE_HEADER = "x-mserve-response-too-large"


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
    cached: bool = False  # defined with add_metric_to_cache: no default dimensions added


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
                cached=entry.get("cached") is True,
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
