"""Property-based tests of the worker frame codec (docs/protocol.md): valid frames of every kind
round-trip in both directions however the stream is cut; arbitrary bytes and mutated frames
(flipped bytes, truncations, oversized lengths, bad JSON meta, wrong types in meta fields,
unknown kinds) fed to either side's decoder and parsers only ever raise ``ProtocolError``, hold
no more than the documented limits, and what they accept comes out with the documented types.

Bounded and reproducible: ``derandomize`` and no example database, so CI tries the same cases on
every run; ``FUZZ_EXAMPLES`` examples per property. The byte-level tests with exact messages are
in test_protocol.py; the real worker runtime and a real server fed garbage are in
test_runtime.py and tests/server/test_faults.py."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mserve_worker import protocol
from mserve_worker.protocol import (
    HEADER,
    MAX_META_BYTES,
    MAX_U32,
    PROTOCOL_VERSION,
    ChunkItem,
    Decoder,
    Frame,
    Kind,
    ProtocolError,
    RequestItem,
    ResponseItem,
)

FUZZ_EXAMPLES = 200
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=2000,  # ms per example: generous for 2 slow shared cores, yet a hang fails fast
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# The server's decoder is built with the model's max_payload_bytes; a small one here lets the
# payload limit be crossed by generated frames.
SERVER_MAX_PAYLOAD = 256
TO_WORKER = (Kind.INIT, Kind.BATCH, Kind.CANCEL, Kind.RELOAD, Kind.PARK)
TO_SERVER = (
    Kind.HELLO, Kind.READY, Kind.LOAD_FAILED, Kind.RESULT, Kind.BATCH_FAILED, Kind.CHUNK,
    Kind.STEP, Kind.RELOADED, Kind.STARTED, Kind.PARKED,
)  # fmt: skip
assert set(TO_WORKER) | set(TO_SERVER) == set(Kind), "a new kind needs a strategy here"

# -- strategies ----------------------------------------------------------------------------------

# Text as it reaches the codec: any code point, lone surrogates included (an undecodable header
# byte becomes one), which the encoder must carry as \u escapes.
text = st.text(
    st.characters(codec=None) | st.sampled_from(["\ud800", "\udcff", "\x00"]), max_size=12
)
pairs = st.lists(st.tuples(text, text).map(list), max_size=3)
uint = st.integers(0, 2**40)
body = st.binary(max_size=48)
json_scalar = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | text
)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=6,
)
json_object = st.dictionaries(text, json_value, max_size=4)

request_item = st.builds(
    RequestItem,
    request_id=text,
    content_type=text,
    headers=pairs,
    body=body,
    params=st.dictionaries(text, text, max_size=3),
    op=text,
)
response_item = st.builds(
    ResponseItem, status=st.integers(100, 599), body=body, content_type=text, headers=pairs
)
chunk_item = st.builds(
    ChunkItem,
    index=uint,
    body=body,
    status=st.just(0) | st.integers(100, 599),
    content_type=text,
    headers=pairs,
)
metric = st.fixed_dictionaries(
    {
        "name": text,
        "value": st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False),
        "unit": text,
        "kind": st.sampled_from(protocol.METRIC_KINDS),
        "request_id": st.none() | text,
        "dimensions": pairs,
    },
    optional={"type": st.sampled_from(protocol.METRIC_TYPES)},
)


@st.composite
def result_frames(draw: st.DrawFn) -> Frame:
    return protocol.result_frame(
        draw(uint),
        draw(st.lists(response_item, max_size=4)),
        handler_ms=draw(st.none() | st.floats(0, 1e9)),
        metrics=draw(st.none() | st.lists(metric, max_size=3)),
    )


@st.composite
def step_frames(draw: st.DrawFn) -> Frame:
    """A continuous-batching step: its answers (or its failure) and each request's place."""
    if draw(st.booleans()):
        reply = draw(result_frames())
        size = len(reply.meta["responses"])
    else:
        reply = Frame(Kind.BATCH_FAILED, {"error": draw(text), "traceback": ""})
        size = draw(st.integers(0, 4))
    members = draw(st.lists(st.tuples(uint, uint), min_size=size, max_size=size))
    return protocol.step_frame(draw(uint), members, reply)


FRAMES: dict[Kind, st.SearchStrategy[Frame]] = {
    Kind.HELLO: st.builds(
        lambda pid, python: Frame(
            Kind.HELLO,
            {
                "protocol": PROTOCOL_VERSION,
                "pid": pid,
                "python": python,
                "runtime": "mserve-worker",
            },
        ),
        st.integers(1, 2**22),
        text,
    ),
    Kind.INIT: json_object.map(lambda meta: Frame(Kind.INIT, meta)),
    Kind.READY: st.builds(
        lambda load_s, style: Frame(Kind.READY, {"load_s": load_s, "style": style}),
        st.floats(0, 1e6),
        text,
    ),
    Kind.LOAD_FAILED: st.builds(
        lambda error, tb: Frame(Kind.LOAD_FAILED, {"error": error, "traceback": tb}), text, text
    ),
    Kind.BATCH: st.builds(protocol.batch_frame, uint, st.lists(request_item, max_size=4)),
    Kind.RESULT: result_frames(),
    Kind.BATCH_FAILED: st.builds(
        lambda batch_id, error: Frame(
            Kind.BATCH_FAILED, {"batch_id": batch_id, "error": error, "traceback": ""}
        ),
        uint,
        text,
    ),
    Kind.CANCEL: st.builds(protocol.cancel_frame, uint, st.lists(text, max_size=4)),
    Kind.STARTED: st.builds(protocol.started_frame, uint),
    Kind.CHUNK: st.builds(protocol.chunk_frame, uint, st.lists(chunk_item, max_size=4)),
    Kind.STEP: step_frames(),
    Kind.RELOAD: st.builds(protocol.reload_frame, uint, st.sampled_from(protocol.RELOAD_STEPS)),
    Kind.RELOADED: st.builds(
        lambda reload_id, step, error, line: protocol.reloaded_frame(
            protocol.Reloaded(reload_id, step, error is None, error or "", "", "h.py", line)
        ),
        uint,
        st.sampled_from(protocol.RELOAD_STEPS),
        st.none() | text,
        st.none() | uint,
    ),
    Kind.PARK: st.builds(protocol.park_frame, uint),
    Kind.PARKED: st.builds(
        lambda park_id, error, size, seconds: protocol.parked_frame(
            protocol.Parked(park_id, error is None, error or "", size, seconds)
        ),
        uint,
        st.none() | text,
        uint,
        st.floats(0, 1e6),
    ),
}
any_frame = st.sampled_from(list(Kind)).flatmap(lambda kind: FRAMES[kind])


def cuts(data: bytes) -> st.SearchStrategy[list[int]]:
    """Sorted offsets at which to split ``data`` into the pieces a transport delivers."""
    return st.lists(st.integers(0, len(data)), max_size=6).map(sorted)


def pieces(data: bytes, offsets: list[int]) -> list[bytes]:
    bounds = [0, *offsets, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


# -- the two sides -------------------------------------------------------------------------------


def _is_pairs(value: object) -> bool:
    return type(value) is list and all(
        type(p) is list and len(p) == 2 and all(type(s) is str for s in p) for p in value
    )


def _is_uint(value: object) -> bool:
    return type(value) is int and value >= 0


def _is_status(value: object) -> bool:
    return type(value) is int and 100 <= value <= 599


def parse_as_worker(frame: Frame) -> Any:
    """What the worker runtime reads out of a frame: INIT's meta, a BATCH, a CANCEL; other kinds
    it ignores. Whatever is accepted has the documented types."""
    if frame.kind is Kind.BATCH:
        batch_id, items = protocol.parse_batch(frame)
        assert _is_uint(batch_id)
        for item in items:
            assert type(item.request_id) is str and type(item.content_type) is str
            assert type(item.op) is str and _is_pairs(item.headers)
            assert type(item.params) is dict
            assert all(type(k) is str and type(v) is str for k, v in item.params.items())
            assert type(item.body) is memoryview
        assert sum(len(item.body) for item in items) == len(frame.payload)
        return batch_id, items
    if frame.kind is Kind.CANCEL:
        batch_id, ids = protocol.parse_cancel(frame)
        assert _is_uint(batch_id) and all(type(i) is str for i in ids)
        return batch_id, ids
    if frame.kind is Kind.RELOAD:
        reload_id, step = protocol.parse_reload(frame)
        assert _is_uint(reload_id) and step in protocol.RELOAD_STEPS
        return reload_id, step
    if frame.kind is Kind.PARK:
        park_id = protocol.parse_park(frame)
        assert _is_uint(park_id)
        return park_id
    assert type(frame.meta) is dict
    return frame.meta


def parse_as_server(frame: Frame) -> Any:
    """What the server reads out of a frame: RESULT (with its metrics), CHUNK, and the handshake
    and failure frames' metas."""
    if frame.kind is Kind.RESULT:
        batch_id, items = protocol.parse_result(frame)
        assert _is_uint(batch_id)
        for item in items:
            assert _is_status(item.status) and type(item.content_type) is str
            assert _is_pairs(item.headers) and type(item.body) is memoryview
        handler_ms, entries = protocol.parse_result_metrics(frame)
        assert handler_ms is None or (type(handler_ms) in (int, float) and handler_ms >= 0)
        for e in entries:
            assert type(e.name) is str and type(e.unit) is str and _is_pairs(e.dimensions)
            assert type(e.value) in (int, float) and e.value == e.value
            assert e.kind in protocol.METRIC_KINDS
            assert e.type is None or e.type in protocol.METRIC_TYPES
            assert e.request_id is None or type(e.request_id) is str
        return batch_id, items, handler_ms, entries
    if frame.kind is Kind.STEP:
        members, items = protocol.parse_step(frame)
        assert all(_is_uint(b) and _is_uint(i) for b, i in members)
        if items is None:
            assert type(frame.meta["error"]) is str
        else:
            assert len(items) == len(members)
            for item in items:
                assert _is_status(item.status) and type(item.content_type) is str
                assert _is_pairs(item.headers) and type(item.body) is memoryview
        handler_ms, _ = protocol.parse_result_metrics(frame)
        return members, items, handler_ms
    if frame.kind is Kind.CHUNK:
        batch_id, chunks = protocol.parse_chunk(frame)
        assert _is_uint(batch_id)
        for chunk in chunks:
            assert _is_uint(chunk.index) and type(chunk.body) is memoryview
            assert chunk.status == 0 or _is_status(chunk.status)
            assert type(chunk.content_type) is str and _is_pairs(chunk.headers)
        return batch_id, chunks
    if frame.kind is Kind.RELOADED:
        answer = protocol.parse_reloaded(frame)
        assert _is_uint(answer.reload_id) and answer.step in protocol.RELOAD_STEPS
        assert type(answer.ok) is bool and type(answer.error) is str
        assert answer.line is None or _is_uint(answer.line)
        return answer
    if frame.kind is Kind.PARKED:
        parked = protocol.parse_parked(frame)
        assert _is_uint(parked.park_id)
        assert type(parked.ok) is bool and type(parked.error) is str
        assert _is_uint(parked.bytes) and type(parked.seconds) is float and parked.seconds >= 0
        return parked
    assert type(frame.meta) is dict
    return frame.meta


SIDES: dict[str, tuple[Callable[[], Decoder], Callable[[Frame], Any], int]] = {
    # side: (its decoder, how it reads frames, its payload limit)
    "worker": (Decoder, parse_as_worker, protocol.DEFAULT_MAX_PAYLOAD_BYTES),
    "server": (lambda: Decoder(SERVER_MAX_PAYLOAD), parse_as_server, SERVER_MAX_PAYLOAD),
}


def feed_untrusted(side: str, chunks: list[bytes]) -> list[Frame]:
    """Feed ``chunks`` to ``side``'s decoder and parse every frame as that side does. The only
    exception allowed out is ProtocolError; after one the decoder refuses everything. Holds no
    more than one frame's worth within the documented limits."""
    make, parse, max_payload = SIDES[side]
    decoder = make()
    frames: list[Frame] = []
    for i, chunk in enumerate(chunks):
        try:
            got = decoder.feed(chunk)
        except ProtocolError as exc:
            assert str(exc)
            event(f"{side} decoder: ProtocolError")
            for later in chunks[i + 1 :] or [b"x"]:
                with pytest.raises(ProtocolError, match="decoder stopped after an earlier error"):
                    decoder.feed(later)
            break
        assert decoder.buffered <= HEADER.size + MAX_META_BYTES + max_payload
        for frame in got:
            assert type(frame.kind) is Kind and type(frame.payload) is bytearray
            assert len(frame.payload) <= max_payload
            frames.append(frame)
    for frame in frames:
        try:
            parse(frame)
        except ProtocolError as exc:
            assert str(exc)
            event(f"{side} parser: ProtocolError on {frame.kind.name}")
        else:
            event(f"{side} parser: accepted {frame.kind.name}")
    return frames


# -- valid frames round-trip ---------------------------------------------------------------------


def _same_items(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        names = getattr(x, "__dataclass_fields__", None) or (
            "request_id",
            "content_type",
            "headers",
            "body",
            "params",
            "op",
            "api",
        )  # RequestItem is a plain class (its headers are read lazily)
        for name in names:
            left, right = getattr(x, name), getattr(y, name)
            if name == "body":
                left, right = bytes(left), bytes(right)
            if name == "headers":
                left, right = [list(p) for p in left], [list(p) for p in right]
            assert left == right, name


@pytest.mark.parametrize("direction", ["to worker", "to server"])
@FUZZ
@given(data=st.data())
def test_valid_frames_round_trip_however_the_stream_is_cut(
    direction: str, data: st.DataObject
) -> None:
    """A stream of valid frames of this direction's kinds, cut anywhere, decodes to the same
    frames, and each side's parser reads back what the builder was given."""
    kinds = TO_WORKER if direction == "to worker" else TO_SERVER
    side = "worker" if direction == "to worker" else "server"
    sent = data.draw(
        st.lists(st.sampled_from(kinds).flatmap(FRAMES.__getitem__), min_size=1, max_size=4)
    )
    sent = [f for f in sent if side == "worker" or len(f.payload) <= SERVER_MAX_PAYLOAD]
    stream = b"".join(protocol.encode_bytes(f) for f in sent)
    offsets = data.draw(cuts(stream))
    got = feed_untrusted(side, pieces(stream, offsets))
    assert len(got) == len(sent)
    parse = SIDES[side][1]
    for before, after in zip(sent, got, strict=True):
        assert after.kind is before.kind
        assert bytes(after.payload) == bytes(before.payload)
        # meta travels as JSON: what was sent is what JSON gives back
        assert after.meta == json.loads(json.dumps(before.meta))
        if before.kind in (Kind.BATCH, Kind.CANCEL, Kind.RESULT, Kind.CHUNK):
            sent_parsed, got_parsed = parse(before), parse(after)
            assert sent_parsed[0] == got_parsed[0]  # batch_id
            if before.kind is Kind.CANCEL:
                assert sent_parsed[1] == got_parsed[1]
            else:
                _same_items(sent_parsed[1], got_parsed[1])
            if before.kind is Kind.RESULT:
                assert sent_parsed[2:] == got_parsed[2:]
        if before.kind is Kind.STEP:
            sent_parsed, got_parsed = parse(before), parse(after)
            assert sent_parsed[0] == got_parsed[0]  # members
            if sent_parsed[1] is None:
                assert got_parsed[1] is None
            else:
                _same_items(sent_parsed[1], got_parsed[1])
            assert sent_parsed[2] == got_parsed[2]


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
@settings(FUZZ, max_examples=25)
@given(data=st.data())
def test_every_kind_decodes_on_both_sides(kind: Kind, data: st.DataObject) -> None:
    """Each kind, whichever way it normally travels, decodes on either side's decoder (a kind in
    the wrong direction is the owner's business, not the codec's)."""
    frame = data.draw(FRAMES[kind])
    encoded = protocol.encode_bytes(frame)
    for side in SIDES:
        got = feed_untrusted(side, pieces(encoded, data.draw(cuts(encoded))))
        if len(frame.payload) <= SIDES[side][2]:
            assert [f.kind for f in got] == [kind]


# -- untrusted bytes ------------------------------------------------------------------------------


@pytest.mark.parametrize("side", list(SIDES))
@FUZZ
@given(data=st.data())
def test_arbitrary_bytes_raise_only_protocol_errors(side: str, data: st.DataObject) -> None:
    raw = data.draw(st.binary(max_size=200) | st.binary(max_size=14).map(lambda b: b"MS\x06" + b))
    feed_untrusted(side, pieces(raw, data.draw(cuts(raw))))


@st.composite
def mutated_streams(draw: st.DrawFn) -> bytes:
    """One or two valid frames, one of them broken in one of the ways a faulty peer breaks
    them."""
    frames = draw(st.lists(any_frame, min_size=1, max_size=2))
    target = draw(st.integers(0, len(frames) - 1))
    encoded = [bytearray(protocol.encode_bytes(f)) for f in frames]
    frame, raw = frames[target], encoded[target]
    how = draw(st.sampled_from(["flip", "truncate", "lengths", "meta bytes", "meta field", "kind",
                                "header field"]))  # fmt: skip
    event(f"mutation: {how}")
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(raw) - 1))
            raw[at] ^= draw(st.integers(1, 255))
    elif how == "truncate":
        del raw[draw(st.integers(0, len(raw) - 1)) :]
    elif how == "lengths":
        field = draw(st.sampled_from([6, 10]))  # meta_len, payload_len
        value = draw(st.integers(0, MAX_U32) | st.sampled_from(
            [MAX_META_BYTES, MAX_META_BYTES + 1, SERVER_MAX_PAYLOAD + 1, 2**31, MAX_U32]))  # fmt: skip
        raw[field : field + 4] = value.to_bytes(4, "big")
    elif how == "meta bytes":
        meta = draw(
            st.binary(max_size=40)
            | st.sampled_from([b"", b"[]", b"null", b"1", b'"s"', b"NaN", b'{"a":Infinity}',
                               b"\xef\xbb\xbf{}", b'{"a":' * 50, b"[" * 5000 + b"]" * 5000,
                               b'{"batch_id":' + b"9" * 5000 + b"}", b'{"a":"\\ud800"}'])
        )  # fmt: skip
        raw = bytearray(
            HEADER.pack(b"MS", PROTOCOL_VERSION, frame.kind, 0, len(meta), len(frame.payload))
            + meta
            + bytes(frame.payload)
        )
    elif how == "meta field":
        meta = json.loads(json.dumps(frame.meta))
        _replace_somewhere(draw, meta)
        raw = bytearray(protocol.encode_bytes(Frame(frame.kind, meta, frame.payload)))
    elif how == "kind":
        raw[3] = draw(st.sampled_from([0, *range(len(Kind) + 1, 256)]))
    else:  # magic, version, flags, reserved bytes
        at = draw(st.sampled_from([0, 1, 2, 4, 5, 14, 15]))
        raw[at] ^= draw(st.integers(1, 255))
    encoded[target] = raw
    return b"".join(encoded)


# Every field the parsers read, so that a generated meta lacks or mistypes each of them.
FIELDS = ("batch_id", "requests", "responses", "chunks", "ids", "handler_ms", "metrics", "id",
          "size", "status", "i", "op", "content_type", "headers", "params", "name", "value",
          "unit", "kind", "type", "request_id", "dimensions", "reload_id", "step", "ok", "error",
          "file", "line", "code", "load_s", "kept")  # fmt: skip


def _replace_somewhere(draw: st.DrawFn, meta: dict[str, Any]) -> None:
    """Give one field of ``meta``, or of one of its entries, a value of any JSON type; or remove
    it."""
    containers: list[dict[str, Any]] = [meta]
    for value in meta.values():
        if type(value) is list:
            containers += [e for e in value if type(e) is dict]
    target = draw(st.sampled_from(containers))
    keys = [*target, *FIELDS]
    key = draw(st.sampled_from(keys))
    if key in target and draw(st.booleans()):
        del target[key]
    else:
        target[key] = draw(json_value)


@pytest.mark.parametrize("side", list(SIDES))
@FUZZ
@given(data=st.data())
def test_mutated_frames_raise_only_protocol_errors(side: str, data: st.DataObject) -> None:
    """Whatever a broken peer sends, in one piece or cut anywhere: frames or ProtocolError."""
    stream = data.draw(mutated_streams())
    feed_untrusted(side, pieces(stream, data.draw(cuts(stream))))
    feed_untrusted(side, [stream])


PARSED = (
    Kind.BATCH, Kind.CANCEL, Kind.RESULT, Kind.CHUNK, Kind.RELOAD, Kind.RELOADED, Kind.PARK,
    Kind.PARKED,
)  # fmt: skip


@pytest.mark.parametrize("kind", PARSED, ids=lambda k: k.name)
@FUZZ
@given(data=st.data())
def test_wrong_types_in_meta_fields_raise_only_protocol_errors(
    kind: Kind, data: st.DataObject
) -> None:
    """A well-framed BATCH, CANCEL, RESULT or CHUNK whose meta lacks fields or has values of
    any JSON type where the parser expects others: the parsers of both sides accept it with the
    documented types, or raise ProtocolError."""
    frame = data.draw(FRAMES[kind])
    meta = json.loads(json.dumps(frame.meta))
    for _ in range(data.draw(st.integers(1, 3))):
        _replace_somewhere(data.draw, meta)
    broken = Frame(kind, meta, frame.payload)
    for parse in (parse_as_worker, parse_as_server):
        try:
            parse(broken)
        except ProtocolError as exc:
            assert str(exc)
            event("ProtocolError")
        else:
            event("accepted")
    feed_untrusted("worker", [protocol.encode_bytes(broken)])


@FUZZ
@given(length=st.integers(MAX_META_BYTES + 1, MAX_U32), payload_len=st.integers(0, MAX_U32))
def test_an_oversized_meta_length_is_refused_from_the_header_alone(
    length: int, payload_len: int
) -> None:
    header = HEADER.pack(b"MS", PROTOCOL_VERSION, Kind.BATCH, 0, length, payload_len)
    for side in SIDES:
        decoder = SIDES[side][0]()
        for byte in range(HEADER.size - 1):  # nothing to say before the header is whole
            assert decoder.feed(header[byte : byte + 1]) == []
        with pytest.raises(ProtocolError, match="exceeds the limit"):
            decoder.feed(header[-1:])


@FUZZ
@given(
    meta_len=st.integers(0, MAX_META_BYTES),
    payload_len=st.integers(0, SERVER_MAX_PAYLOAD),
    sent=st.integers(0, 4096),
)
def test_a_frame_announced_within_the_limits_holds_only_what_arrived(
    meta_len: int, payload_len: int, sent: int
) -> None:
    """The decoder grows its buffers as bytes arrive: a peer that announces 16 MiB of meta and
    sends a little costs a little."""
    header = HEADER.pack(b"MS", PROTOCOL_VERSION, Kind.RESULT, 0, meta_len, payload_len)
    decoder = Decoder(SERVER_MAX_PAYLOAD)
    body = b" " * min(sent, meta_len + payload_len - 1) if meta_len + payload_len else b""
    try:
        decoder.feed(header + body)
    except ProtocolError:  # the meta was complete (all blanks): not JSON
        assert len(body) >= meta_len
        return
    assert decoder.buffered == HEADER.size + len(body)
