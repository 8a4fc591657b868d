"""The worker frame codec, at byte level: exact bytes, every split point, every error message."""

from __future__ import annotations

import array
import time
from dataclasses import replace

import pytest

from mserve_worker import protocol
from mserve_worker.protocol import (
    HEADER,
    MAX_META_BYTES,
    PROTOCOL_VERSION,
    ChunkItem,
    Decoder,
    Frame,
    Kind,
    MetricEntry,
    ProtocolError,
    RequestItem,
    ResponseItem,
    batch_frame,
    cancel_frame,
    chunk_frame,
    encode,
    encode_bytes,
    parse_batch,
    parse_cancel,
    parse_chunk,
    parse_result,
    parse_result_metrics,
    result_frame,
)

HELLO_META = {"protocol": 2, "pid": 4242, "python": "3.11.7", "runtime": "mserve-worker"}
ALL_BYTES = bytes(range(256))


def decode_all(data: bytes, **kwargs: int) -> list[Frame]:
    decoder = Decoder(**kwargs)
    frames = decoder.feed(data)
    assert decoder.buffered == 0
    return frames


def raw_frame(
    meta: bytes = b"{}",
    payload: bytes = b"",
    *,
    magic: bytes = b"MS",
    version: int = PROTOCOL_VERSION,
    kind: int = Kind.READY,
    flags: int = 0,
    meta_len: int | None = None,
    payload_len: int | None = None,
) -> bytes:
    """Bytes as a (possibly broken) peer would send them, bypassing the encoder's checks."""
    meta_len = len(meta) if meta_len is None else meta_len
    payload_len = len(payload) if payload_len is None else payload_len
    return HEADER.pack(magic, version, kind, flags, meta_len, payload_len) + meta + payload


# -- exact bytes ---------------------------------------------------------------------------------


def test_hello_frame_bytes_are_exact() -> None:
    meta = b'{"protocol":2,"pid":4242,"python":"3.11.7","runtime":"mserve-worker"}'
    header = bytes.fromhex("4d53 06 01 0000 00000045 00000000 0000")
    assert len(meta) == 0x45
    assert encode_bytes(Frame(Kind.HELLO, HELLO_META)) == header + meta


def test_batch_frame_bytes_match_the_worked_example_in_the_docs() -> None:
    expected = bytes.fromhex(
        "4d53 06 05 0000 00000034 00000002 0000"
        "7b22 6261 7463 685f 6964 223a 372c 2272 6571 7565 7374 7322 3a5b 5b22 7231 222c"
        "2274 6578 742f 706c 6169 6e22 2c32 2c22 225d 5d7d"
        "6869"
    )
    frame = batch_frame(7, [RequestItem("r1", "text/plain", [], b"hi")])
    assert encode_bytes(frame) == expected


def test_header_is_16_bytes_with_the_documented_fields() -> None:
    assert HEADER.size == 16
    packed = HEADER.pack(b"MS", 1, 5, 0, 0x01020304, 0x0A0B0C0D)
    assert packed == bytes.fromhex("4d53 01 05 0000 01020304 0a0b0c0d 0000")
    assert HEADER.unpack(packed) == (b"MS", 1, 5, 0, 0x01020304, 0x0A0B0C0D)


def test_encode_returns_header_and_payload_without_copying_the_payload() -> None:
    payload = b"x" * 1000
    parts = encode(Frame(Kind.BATCH, {"batch_id": 1}, payload))
    assert len(parts) == 2
    assert parts[1] is payload
    assert parts[0][:2] == b"MS" and parts[0][16:] == b'{"batch_id":1}'


def test_encode_omits_an_empty_payload() -> None:
    parts = encode(Frame(Kind.READY, {"load_s": 0.5, "style": "handler class"}))
    assert len(parts) == 1


def test_encode_accepts_any_contiguous_buffer_as_payload() -> None:
    ints = array.array("i", [1, 2, 3])
    parts = encode(Frame(Kind.RESULT, {}, memoryview(ints)))
    assert HEADER.unpack(parts[0][:16])[5] == 3 * ints.itemsize
    assert bytes(parts[1]) == ints.tobytes()
    assert parts[1].obj is ints


def test_non_ascii_meta_travels_as_utf8() -> None:
    data = encode_bytes(Frame(Kind.LOAD_FAILED, {"error": "modèle 模型", "traceback": ""}))
    assert "modèle 模型".encode() in data
    assert decode_all(data)[0].meta["error"] == "modèle 模型"


def test_lone_surrogates_survive_the_trip_as_ascii_escapes() -> None:
    # How Python holds a header byte that was not valid UTF-8 (surrogateescape).
    value = b"caf\xe9".decode("utf-8", "surrogateescape")
    data = encode_bytes(Frame(Kind.INIT, {"header": value}))
    assert data[16:] == b'{"header":"caf\\udce9"}'
    assert decode_all(data)[0].meta == {"header": value}


# -- round trips and stream splitting ------------------------------------------------------------

EXAMPLES = {
    Kind.HELLO: Frame(Kind.HELLO, HELLO_META),
    Kind.INIT: Frame(Kind.INIT, {"model": "m", "gpu_id": None, "nested": {"a": [1, 2.5, True]}}),
    Kind.READY: Frame(Kind.READY, {"load_s": 1.25, "style": "module function"}),
    Kind.LOAD_FAILED: Frame(Kind.LOAD_FAILED, {"error": "boom", "traceback": "Traceback..."}),
    Kind.BATCH: batch_frame(3, [RequestItem("a", "", [], ALL_BYTES)]),
    Kind.RESULT: result_frame(3, [ResponseItem(200, b"ok")]),
    Kind.BATCH_FAILED: Frame(Kind.BATCH_FAILED, {"batch_id": 3, "error": "e", "traceback": "t"}),
    Kind.CANCEL: cancel_frame(4, ["r2", "r3"]),
    Kind.STARTED: protocol.started_frame(4),
    Kind.CHUNK: chunk_frame(3, [ChunkItem(0, b"tok", 200, "text/plain", [["X-A", "1"]])]),
    Kind.RELOAD: protocol.reload_frame(3, "prepare"),
    Kind.RELOADED: protocol.reloaded_frame(
        protocol.Reloaded(3, "prepare", False, "SyntaxError: x", "t", "handler.py", 7)
    ),
    Kind.PARK: protocol.park_frame(5),
    Kind.PARKED: protocol.parked_frame(protocol.Parked(5, True, bytes=2**29, seconds=0.02)),
    Kind.STEP: protocol.step_frame(
        7, [(3, 0), (5, 1)], result_frame(7, [ResponseItem(200, b"a"), ResponseItem(200, b"b")])
    ),
}


def test_a_step_names_each_request_by_the_batch_that_brought_it() -> None:
    """Continuous batching run by the worker: one STEP per handler call, each answer with the
    BATCH frame and place of its request; a failed call names its requests and the error."""
    reply = result_frame(
        7, [ResponseItem(200, b"tok", "", [["ts_stream_next", "true"]]), ResponseItem(200, b"end")],
        handler_ms=1.5,
    )  # fmt: skip
    (got,) = decode_all(encode_bytes(protocol.step_frame(7, [(3, 0), (5, 1)], reply)))
    members, items = protocol.parse_step(got)
    assert members == [(3, 0), (5, 1)]
    assert items is not None and [bytes(i.body) for i in items] == [b"tok", b"end"]
    assert items[0].headers == [["ts_stream_next", "true"]]
    assert protocol.parse_result_metrics(got) == (1.5, [])
    failed = Frame(Kind.BATCH_FAILED, {"error": "RuntimeError: boom", "traceback": "t"})
    (got,) = decode_all(encode_bytes(protocol.step_frame(8, [(9, 0)], failed)))
    assert protocol.parse_step(got) == ([(9, 0)], None)
    assert got.meta["error"] == "RuntimeError: boom"


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"batch_id": 1, "members": [[1]], "responses": []},
         "STEP members must be a list of [batch_id, index] pairs"),
        ({"batch_id": 1, "members": [[1, -2]], "responses": []},
         "STEP members must be a list of [batch_id, index] pairs"),
        ({"batch_id": 1, "members": [[1, 0], [1, 1]], "responses": []},
         "STEP has 2 members but 0 responses"),
        ({"batch_id": 1, "members": [[1, 0]], "failed": True},
         "STEP meta lacks the required field 'error'"),
    ],
)  # fmt: skip
def test_a_malformed_step_is_refused_with_what_is_wrong(meta: dict, message: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        protocol.parse_step(Frame(Kind.STEP, meta))
    assert str(caught.value) == message


def test_every_kind_has_an_example() -> None:
    assert set(EXAMPLES) == set(Kind)


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_round_trip(kind: Kind) -> None:
    frame = EXAMPLES[kind]
    (decoded,) = decode_all(encode_bytes(frame))
    assert decoded == frame
    assert type(decoded.kind) is Kind and decoded.kind is kind
    assert isinstance(decoded.payload, bytearray)
    assert bytes(decoded.payload) == bytes(frame.payload)


def test_a_payload_on_a_control_kind_round_trips() -> None:
    frame = Frame(Kind.INIT, {}, b"\x00extra")
    assert decode_all(encode_bytes(frame)) == [frame]


STREAM_FRAMES = [
    EXAMPLES[Kind.HELLO],
    batch_frame(
        9,
        [
            RequestItem("r1", "application/octet-stream", [["X-Ünï", "値"]], ALL_BYTES),
            RequestItem("r2", "", [], b""),
        ],
    ),
    chunk_frame(9, [ChunkItem(1, b"first", 201, "text/plain", [["X-Ünï", "値"]])]),
    chunk_frame(9, [ChunkItem(1, ALL_BYTES[:8]), ChunkItem(0, b"")]),
    Frame(Kind.READY, {}),
]
STREAM = b"".join(encode_bytes(f) for f in STREAM_FRAMES)
FRAME_ENDS = [
    sum(len(encode_bytes(f)) for f in STREAM_FRAMES[: i + 1]) for i in range(len(STREAM_FRAMES))
]


def expected_buffered(offset: int) -> int:
    return offset - max([end for end in FRAME_ENDS if end <= offset], default=0)


def test_stream_split_at_every_offset() -> None:
    for i in range(len(STREAM) + 1):
        decoder = Decoder()
        first = decoder.feed(STREAM[:i])
        assert first == STREAM_FRAMES[: sum(end <= i for end in FRAME_ENDS)], i
        assert decoder.buffered == expected_buffered(i), i
        assert first + decoder.feed(STREAM[i:]) == STREAM_FRAMES, i
        assert decoder.buffered == 0


def test_stream_fed_one_byte_at_a_time() -> None:
    decoder = Decoder()
    frames = []
    for i in range(len(STREAM)):
        frames += decoder.feed(STREAM[i : i + 1])
        assert decoder.buffered == expected_buffered(i + 1)
    assert frames == STREAM_FRAMES
    assert parse_batch(frames[1])[1][0].headers == [["X-Ünï", "値"]]


def test_feed_takes_bytearray_and_memoryview_and_keeps_no_reference_to_them() -> None:
    decoder = Decoder()
    chunk = bytearray(STREAM[:100])
    frames = decoder.feed(chunk)
    del chunk[:]  # would raise BufferError if the decoder still held a view of it
    frames += decoder.feed(memoryview(STREAM)[100:])
    assert frames == STREAM_FRAMES
    assert decoder.feed(b"") == []


def test_decoded_payload_is_independent_of_the_input_buffer() -> None:
    data = bytearray(encode_bytes(Frame(Kind.INIT, {}, b"abc")))
    (frame,) = Decoder().feed(data)
    data[-3:] = b"xyz"
    assert frame.payload == b"abc"


def test_large_payload_in_64k_chunks_decodes_in_linear_time() -> None:
    size = 100 * 1024 * 1024
    payload = ALL_BYTES * (size // len(ALL_BYTES))
    item = ResponseItem(200, payload, "application/octet-stream")
    data = memoryview(encode_bytes(result_frame(1, [item])))
    decoder = Decoder()
    frames = []
    started = time.perf_counter()
    for offset in range(0, len(data), 64 * 1024):
        frames += decoder.feed(data[offset : offset + 64 * 1024])
    elapsed = time.perf_counter() - started
    (frame,) = frames
    assert frame.payload == payload
    assert parse_result(frame)[1][0].body == payload
    # Typically ~0.1 s; re-copying the buffer per chunk would take minutes. Loose for slow CI.
    assert elapsed < 5.0


# -- decode errors -------------------------------------------------------------------------------

DECODE_ERRORS = [
    (
        "magic",
        raw_frame(magic=b"GE"),
        "bad frame magic b'GE', expected b'MS': the peer is not speaking the mserve worker protocol",
    ),
    ("version", raw_frame(version=1), "unsupported protocol version 1, this side speaks 6"),
    (
        "kind 0",
        raw_frame(kind=0),
        "unknown frame kind 0, expected one of 1 (HELLO), 2 (INIT), 3 (READY), 4 (LOAD_FAILED), "
        "5 (BATCH), 6 (RESULT), 7 (BATCH_FAILED), 8 (CANCEL), 9 (CHUNK), 10 (STEP)",
    ),
    ("kind 16", raw_frame(kind=16), "unknown frame kind 16, expected one of 1 (HELLO), "),
    ("flags", raw_frame(flags=0x8001), "frame flags must be 0 (reserved), got 0x8001"),
    (
        "reserved",
        raw_frame()[:15] + b"\x07" + b"{}",
        "frame header bytes 14-15 are reserved and must be 0, got 0x0007",
    ),
    (
        "meta_len",
        raw_frame(meta_len=MAX_META_BYTES + 1),
        "frame meta_len 16777217 bytes exceeds the limit of 16777216 bytes",
    ),
    (
        "utf-8",
        raw_frame(b'{"a":"\xff"}'),
        "READY frame meta is not valid UTF-8: 'utf-8' codec can't decode byte 0xff in position 6",
    ),
    (
        "empty meta",
        raw_frame(b""),
        "READY frame meta is not valid JSON: Expecting value: line 1 column 1 (char 0)",
    ),
    (
        "truncated json",
        raw_frame(b'{"a":'),
        "READY frame meta is not valid JSON: Expecting value: line 1 column 6 (char 5)",
    ),
    (
        "bom",
        raw_frame(b"\xef\xbb\xbf{}"),
        "READY frame meta is not valid JSON: Unexpected UTF-8 BOM",
    ),
    ("nan", raw_frame(b'{"load_s":NaN}'), "frame meta contains NaN, which is not valid JSON"),
    (
        "infinity",
        raw_frame(b'{"load_s":-Infinity}'),
        "frame meta contains -Infinity, which is not valid JSON",
    ),
    ("array", raw_frame(b"[1,2]"), "READY frame meta must be a JSON object, got a JSON array"),
    ("null", raw_frame(b"null"), "READY frame meta must be a JSON object, got a JSON null"),
    ("string", raw_frame(b'"{}"'), "READY frame meta must be a JSON object, got a JSON string"),
    ("number", raw_frame(b"1"), "READY frame meta must be a JSON object, got a JSON number"),
    ("deep", raw_frame(b"[" * 100_000), "READY frame meta nests too deeply to decode"),
]


@pytest.mark.parametrize(
    ("data", "message"), [c[1:] for c in DECODE_ERRORS], ids=[c[0] for c in DECODE_ERRORS]
)
def test_decode_error(data: bytes, message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        Decoder().feed(data)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("data", "message"), [c[1:] for c in DECODE_ERRORS], ids=[c[0] for c in DECODE_ERRORS]
)
def test_decode_error_is_the_same_when_the_frame_comes_in_pieces(data: bytes, message: str) -> None:
    # A whole frame is read straight from the input, a cut one through the decoder's buffer.
    decoder = Decoder()
    with pytest.raises(ProtocolError) as info:
        for i in range(0, len(data), 7):
            decoder.feed(data[i : i + 7])
    assert str(info.value).startswith(message)


def test_payload_over_the_decoders_limit() -> None:
    with pytest.raises(ProtocolError) as info:
        Decoder(max_payload_bytes=10).feed(raw_frame(payload=b"x" * 11))
    assert str(info.value) == "frame payload_len 11 bytes exceeds the limit of 10 bytes"
    assert len(decode_all(raw_frame(payload=b"x" * 10), max_payload_bytes=10)[0].payload) == 10


def test_default_payload_limit_is_2_gib_minus_1() -> None:
    header = raw_frame(payload_len=2**31)
    with pytest.raises(
        ProtocolError, match="payload_len 2147483648 bytes exceeds the limit of 2147483647 bytes"
    ):
        Decoder().feed(header)


def test_header_errors_need_only_the_header() -> None:
    # A bad length is refused before any of the meta or payload it announces is awaited.
    decoder = Decoder(max_payload_bytes=1024)
    assert decoder.feed(raw_frame(payload_len=2**32 - 1)[:15]) == []
    with pytest.raises(
        ProtocolError, match="payload_len 4294967295 bytes exceeds the limit of 1024"
    ):
        decoder.feed(raw_frame(payload_len=2**32 - 1)[15:16])


def test_a_failed_decoder_refuses_further_input() -> None:
    decoder = Decoder()
    with pytest.raises(ProtocolError):
        decoder.feed(raw_frame(version=9))
    with pytest.raises(ProtocolError) as info:
        decoder.feed(encode_bytes(Frame(Kind.READY, {})))
    assert str(info.value) == (
        "decoder stopped after an earlier error: unsupported protocol version 9, this side speaks 6"
    )


def test_an_error_drops_the_frames_completed_in_the_same_feed() -> None:
    # Documented: the channel is closed on any ProtocolError, so nothing after it is trusted.
    decoder = Decoder()
    with pytest.raises(ProtocolError, match="bad frame magic"):
        decoder.feed(encode_bytes(Frame(Kind.READY, {})) + raw_frame(magic=b"XX"))


def test_encode_takes_a_plain_int_kind() -> None:
    assert decode_all(encode_bytes(Frame(3, {})))[0].kind is Kind.READY  # type: ignore[arg-type]


@pytest.mark.parametrize("limit", [-1, 2**32, 1.5, True])
def test_decoder_limit_must_fit_u32(limit: object) -> None:
    with pytest.raises(ValueError, match=r"max_payload_bytes must be an int in 0\.\.4294967295"):
        Decoder(max_payload_bytes=limit)  # type: ignore[arg-type]


# -- encode errors -------------------------------------------------------------------------------

ENCODE_ERRORS = [
    ("kind", Frame(16, {}), "unknown frame kind 16, expected one of 1 (HELLO)"),  # type: ignore[arg-type]
    (
        "meta list",
        Frame(Kind.INIT, [1]),
        "INIT frame meta must be a dict (a JSON object), got list",
    ),  # type: ignore[arg-type]
    (
        "meta object",
        Frame(Kind.INIT, {"a": object()}),
        "INIT frame meta is not JSON-serialisable: Object of type object is not JSON serializable",
    ),
    (
        "meta nan",
        Frame(Kind.READY, {"load_s": float("nan")}),
        "READY frame meta is not JSON-serialisable: Out of range float values are not JSON compliant",
    ),
    (
        "payload str",
        Frame(Kind.BATCH, {}, "text"),
        "BATCH frame payload must be bytes-like, got str",
    ),  # type: ignore[arg-type]
    (
        "payload strided",
        Frame(Kind.BATCH, {}, memoryview(b"abcd")[::2]),
        "BATCH frame payload must be a contiguous buffer",
    ),
    (
        "meta size",
        Frame(Kind.INIT, {"a": "x" * MAX_META_BYTES}),
        "frame meta_len 16777224 bytes exceeds the limit of 16777216 bytes",
    ),
]


@pytest.mark.parametrize(
    ("frame", "message"), [c[1:] for c in ENCODE_ERRORS], ids=[c[0] for c in ENCODE_ERRORS]
)
def test_encode_error(frame: Frame, message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        encode(frame)
    assert str(info.value).startswith(message)


# -- batch and result layout ---------------------------------------------------------------------

REQUESTS = [
    RequestItem("r-empty", "", [], b""),
    RequestItem(
        "r-binary",
        "application/octet-stream",
        [["Content-Type", "application/octet-stream"], ["X-Trace", "1"], ["X-Trace", "2"]],
        ALL_BYTES,
        {"version": "2", "q": "naïve"},
    ),
    RequestItem(
        "r-unicode", "text/plain; charset=utf-8", [["X-Ünicode", "日本語 ✓"]], "π".encode()
    ),
    RequestItem("r-empty-2", "", [], bytearray()),
]
RESPONSES = [
    ResponseItem(200, b""),
    ResponseItem(200, ALL_BYTES, "application/octet-stream", [["X-Score", "0.9"]]),
    ResponseItem(507, "ß".encode(), "text/plain", [["X-Ünicode", "日本語"]]),
]


def test_batch_meta_layout() -> None:
    frame = batch_frame(42, REQUESTS[:2])
    assert frame.kind is Kind.BATCH
    assert frame.meta == {
        "batch_id": 42,
        "requests": [
            ["r-empty", "", 0, ""],  # packed: predict, no query (docs/protocol.md)
            {
                "id": "r-binary",
                "content_type": "application/octet-stream",
                "headers": [
                    ["Content-Type", "application/octet-stream"],
                    ["X-Trace", "1"],
                    ["X-Trace", "2"],
                ],
                "params": {"version": "2", "q": "naïve"},
                "size": 256,
            },
        ],
    }
    assert frame.payload == ALL_BYTES


def test_result_meta_layout() -> None:
    frame = result_frame(42, RESPONSES[1:])
    assert frame.meta == {
        "batch_id": 42,
        "responses": [
            {
                "status": 200,
                "content_type": "application/octet-stream",
                "headers": [["X-Score", "0.9"]],
                "size": 256,
            },
            {
                "status": 507,
                "content_type": "text/plain",
                "headers": [["X-Ünicode", "日本語"]],
                "size": 2,
            },
        ],
    }
    assert frame.payload == ALL_BYTES + "ß".encode()


def test_result_frame_bytes_do_not_depend_on_the_body_or_headers_type() -> None:
    # bytes bodies and list pairs take a shorter path than other buffers and tuples.
    plain = encode_bytes(result_frame(5, RESPONSES))
    other = [
        ResponseItem(r.status, bytearray(r.body), r.content_type, [tuple(p) for p in r.headers])
        for r in RESPONSES
    ]
    assert encode_bytes(result_frame(5, other)) == plain  # type: ignore[arg-type]
    assert (
        encode_bytes(result_frame(5, [replace(r, body=memoryview(r.body)) for r in RESPONSES]))
        == plain
    )


def test_a_lone_bytes_body_becomes_the_result_payload_uncopied() -> None:
    body = b"z" * 1000
    assert result_frame(1, [ResponseItem(200, body)]).payload is body


def test_batch_round_trip_through_bytes() -> None:
    (frame,) = decode_all(encode_bytes(batch_frame(42, REQUESTS)))
    batch_id, items = parse_batch(frame)
    assert batch_id == 42
    assert items == REQUESTS
    for item in items:
        assert isinstance(item.body, memoryview)
        assert item.body.obj is frame.payload


def test_a_request_cached_in_the_worker_is_flagged_and_a_new_one_carries_no_flag() -> None:
    again = RequestItem("r1", "", [["h", "v"]], b"", cached=True)
    frame = batch_frame(5, [again, RequestItem("r2", "text/plain", [], b"hi")])
    cached, new = frame.meta["requests"]
    assert cached["cached"] is True  # never packed: the flag needs the object form
    assert type(new) is list  # the usual request stays packed, with no flag
    (decoded,) = decode_all(encode_bytes(frame))
    _, items = parse_batch(decoded)
    assert [i.cached for i in items] == [True, False]
    assert bytes(items[0].body) == b""


def test_result_round_trip_through_bytes() -> None:
    (frame,) = decode_all(encode_bytes(result_frame(7, RESPONSES)))
    batch_id, items = parse_result(frame)
    assert batch_id == 7
    assert items == RESPONSES
    assert [bytes(i.body) for i in items] == [bytes(r.body) for r in RESPONSES]
    assert all(item.body.obj is frame.payload for item in items)  # type: ignore[union-attr]


def test_parse_batch_slices_a_bytes_payload_without_copying() -> None:
    frame = batch_frame(1, REQUESTS)
    _, items = parse_batch(frame)
    assert all(isinstance(i.body, memoryview) and i.body.obj is frame.payload for i in items)


def test_empty_batch_round_trips() -> None:
    (frame,) = decode_all(encode_bytes(batch_frame(0, [])))
    assert parse_batch(frame) == (0, [])
    assert parse_result(result_frame(0, [])) == (0, [])


def test_optional_fields_default_when_absent() -> None:
    batch = Frame(Kind.BATCH, {"batch_id": 1, "requests": [{"id": "a", "size": 1, "new": 1}]}, b"x")
    assert parse_batch(batch) == (1, [RequestItem("a", "", [], b"x", {})])
    result = Frame(Kind.RESULT, {"batch_id": 1, "responses": [{"status": 204, "size": 0}]})
    assert parse_result(result) == (1, [ResponseItem(204, b"", "", [])])


def test_tuple_headers_are_sent_as_pairs() -> None:
    item = RequestItem("a", "", [("K", "v")], b"", op="explain")  # type: ignore[list-item]
    frame = batch_frame(1, [item])
    assert frame.meta["requests"][0]["headers"] == [["K", "v"]]


PARSE_ERRORS = [
    (
        "wrong kind",
        Frame(Kind.RESULT, {"batch_id": 1, "responses": []}),
        parse_batch,
        "expected a BATCH frame, got RESULT",
    ),
    (
        "no batch_id",
        Frame(Kind.BATCH, {"requests": []}),
        parse_batch,
        "BATCH meta lacks the required field 'batch_id'",
    ),
    (
        "batch_id str",
        Frame(Kind.BATCH, {"batch_id": "1", "requests": []}),
        parse_batch,
        "BATCH batch_id must be a non-negative integer, got '1'",
    ),
    (
        "batch_id bool",
        Frame(Kind.RESULT, {"batch_id": True, "responses": []}),
        parse_result,
        "RESULT batch_id must be a non-negative integer, got True",
    ),
    (
        "no requests",
        Frame(Kind.BATCH, {"batch_id": 1}),
        parse_batch,
        "BATCH meta lacks the required field 'requests'",
    ),
    (
        "requests dict",
        Frame(Kind.BATCH, {"batch_id": 1, "requests": {}}),
        parse_batch,
        "BATCH meta 'requests' must be a list of objects or packed arrays",
    ),
    (
        "no size",
        Frame(Kind.BATCH, {"batch_id": 1, "requests": [{"id": "a"}]}),
        parse_batch,
        "BATCH requests[0] lacks the required field 'size'",
    ),
    (
        "negative size",
        Frame(Kind.RESULT, {"batch_id": 1, "responses": [{"status": 200, "size": -1}]}),
        parse_result,
        "RESULT responses[0].size must be a non-negative integer, got -1",
    ),
    (
        "float size",
        Frame(Kind.BATCH, {"batch_id": 1, "requests": [{"id": "a", "size": 1.0}]}, b"x"),
        parse_batch,
        "BATCH requests[0].size must be a non-negative integer, got 1.0",
    ),
    (
        "sizes short",
        Frame(
            Kind.BATCH,
            {"batch_id": 5, "requests": [{"id": "a", "size": 1}, {"id": "b", "size": 1}]},
            b"abc",
        ),
        parse_batch,
        "BATCH 5: requests sizes add up to 2 bytes but the payload holds 3 bytes",
    ),
    (
        "sizes long",
        Frame(Kind.RESULT, {"batch_id": 5, "responses": [{"status": 200, "size": 4}]}, b"abc"),
        parse_result,
        "RESULT 5: responses sizes add up to 4 bytes but the payload holds 3 bytes",
    ),
    (
        "no id",
        Frame(Kind.BATCH, {"batch_id": 1, "requests": [{"size": 0}]}),
        parse_batch,
        "BATCH requests[0] lacks the required field 'id'",
    ),
    (
        "id int",
        Frame(Kind.BATCH, {"batch_id": 1, "requests": [{"id": 3, "size": 0}]}),
        parse_batch,
        "BATCH requests[0].id must be a string, got int",
    ),
    (
        "content_type null",
        Frame(
            Kind.BATCH, {"batch_id": 1, "requests": [{"id": "a", "size": 0, "content_type": None}]}
        ),
        parse_batch,
        "BATCH requests[0].content_type must be a string, got NoneType",
    ),
    (
        "header triple",
        Frame(
            Kind.BATCH,
            {"batch_id": 1, "requests": [{"id": "a", "size": 0, "headers": [["a", "b", "c"]]}]},
        ),
        parse_batch,
        "BATCH requests[0].headers[0] must be a [name, value] pair of strings, got ['a', 'b', 'c']",
    ),
    (
        "headers object",
        Frame(
            Kind.RESULT,
            {"batch_id": 1, "responses": [{"status": 200, "size": 0, "headers": {"a": "b"}}]},
        ),
        parse_result,
        "RESULT responses[0].headers must be a list of [name, value] pairs",
    ),
    (
        "param int",
        Frame(
            Kind.BATCH, {"batch_id": 1, "requests": [{"id": "a", "size": 0, "params": {"n": 1}}]}
        ),
        parse_batch,
        "BATCH requests[0].params must be an object mapping names to string values",
    ),
    (
        "cached not a bool",
        Frame(Kind.BATCH, {"batch_id": 1, "requests": [{"id": "a", "size": 0, "cached": 1}]}),
        parse_batch,
        "BATCH requests[0].cached must be true or false, got 1",
    ),
    (
        "no status",
        Frame(Kind.RESULT, {"batch_id": 1, "responses": [{"size": 0}]}),
        parse_result,
        "RESULT responses[0] lacks the required field 'status'",
    ),
    (
        "status 99",
        Frame(Kind.RESULT, {"batch_id": 1, "responses": [{"status": 99, "size": 0}]}),
        parse_result,
        "RESULT responses[0].status must be an HTTP status in 100..599, got 99",
    ),
    (
        "status str",
        Frame(Kind.RESULT, {"batch_id": 1, "responses": [{"status": "200", "size": 0}]}),
        parse_result,
        "RESULT responses[0].status must be an HTTP status in 100..599, got '200'",
    ),
]


@pytest.mark.parametrize(
    ("frame", "parse", "message"), [c[1:] for c in PARSE_ERRORS], ids=[c[0] for c in PARSE_ERRORS]
)
def test_parse_error(frame: Frame, parse: object, message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse(frame)  # type: ignore[operator]
    assert str(info.value) == message


BUILD_ERRORS = [
    (
        "batch_id",
        lambda: batch_frame(-1, []),
        "BATCH batch_id must be a non-negative integer, got -1",
    ),
    (
        "body str",
        lambda: batch_frame(1, [RequestItem("a", "", [], "text")]),
        "BATCH requests[0].body must be bytes-like, got str",
    ),
    (
        "request_id",
        lambda: batch_frame(1, [RequestItem(1, "", [], b"")]),
        "BATCH requests[0].request_id must be a string, got int",
    ),
    (
        "header pair",
        lambda: batch_frame(1, [RequestItem("a", "", [["k"]], b"")]),
        "BATCH requests[0].headers[0] must be a [name, value] pair of strings, got ['k']",
    ),
    (
        "header bytes",
        lambda: batch_frame(1, [RequestItem("a", "", [[b"k", b"v"]], b"")]),
        "BATCH requests[0].headers[0] must be a [name, value] pair of strings, got [b'k', b'v']",
    ),
    (
        "params",
        lambda: batch_frame(1, [RequestItem("a", "", [], b"", {"n": None})]),
        "BATCH requests[0].params must be an object mapping names to string values",
    ),
    (
        "result body",
        lambda: result_frame(1, [ResponseItem(200, {"a": 1})]),
        "RESULT responses[0].body must be bytes-like, got dict",
    ),
    (
        "status",
        lambda: result_frame(1, [ResponseItem(600, b"")]),
        "RESULT responses[0].status must be an HTTP status in 100..599, got 600",
    ),
    (
        "content_type",
        lambda: result_frame(1, [ResponseItem(200, b"", None)]),
        "RESULT responses[0].content_type must be a string, got NoneType",
    ),
]


@pytest.mark.parametrize(
    ("build", "message"), [c[1:] for c in BUILD_ERRORS], ids=[c[0] for c in BUILD_ERRORS]
)
def test_build_error(build: object, message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        build()  # type: ignore[operator]
    assert str(info.value) == message


def test_unchecked_batch_frame_matches_the_checked_one() -> None:
    """The server's hot path skips the checks but must put the same bytes on the wire."""
    items = [
        RequestItem(
            "r1", "application/json", [["Host", "x"], ["X-A", "é"]], b'{"a": 1}', {"q": "1"}
        ),
        RequestItem("r2", "", [], memoryview(b"\x00\x01"), {}),
    ]
    for batch in (items, items[:1]):
        checked = encode_bytes(batch_frame(3, batch))
        unchecked = encode_bytes(batch_frame(3, batch, check=False))
        assert checked == unchecked


def test_small_frames_go_out_as_one_buffer_large_ones_uncopied() -> None:
    from mserve_worker.protocol import JOIN_BELOW_BYTES, encode_for_send

    small = Frame(Kind.RESULT, {"batch_id": 1, "responses": []}, b"x" * 10)
    (joined,) = encode_for_send(small)
    assert joined == encode_bytes(small)
    payload = b"y" * JOIN_BELOW_BYTES
    big = encode_for_send(Frame(Kind.RESULT, {"batch_id": 1, "responses": []}, payload))
    assert len(big) == 2 and big[1] is payload


def test_cancel_frame_round_trips_and_is_checked() -> None:
    frame = cancel_frame(4, ["r2", "r3"])
    assert encode_bytes(frame)[:4] == b"MS\x06\x08"
    (decoded,) = decode_all(encode_bytes(frame))
    assert parse_cancel(decoded) == (4, ["r2", "r3"])
    with pytest.raises(ProtocolError, match="CANCEL ids must be a list of strings"):
        parse_cancel(Frame(Kind.CANCEL, {"batch_id": 4, "ids": "r2"}))
    with pytest.raises(ProtocolError, match="CANCEL lacks the required field 'batch_id'"):
        parse_cancel(Frame(Kind.CANCEL, {"ids": []}))


# --- handler metrics in RESULT ---------------------------------------------------------------

METRIC = {
    "name": "ItemsSeen",
    "value": 1,
    "unit": "count",
    "kind": "counter",
    "request_id": "a1",
    "dimensions": [["Color", "red"]],
}


def test_result_metrics_keys_are_absent_unless_given() -> None:
    assert set(result_frame(3, [ResponseItem(200, b"ok")]).meta) == {"batch_id", "responses"}
    frame = result_frame(3, [ResponseItem(200, b"ok")], handler_ms=1.5, metrics=[])
    assert set(frame.meta) == {"batch_id", "responses", "handler_ms"}  # no empty list sent


def test_result_with_metrics_bytes_are_exact() -> None:
    frame = result_frame(3, [ResponseItem(200, b"ok")], handler_ms=1.5, metrics=[METRIC])
    meta = (
        b'{"batch_id":3,"responses":[{"status":200,"content_type":"","headers":[],"size":2}],'
        b'"handler_ms":1.5,"metrics":[{"name":"ItemsSeen","value":1,"unit":"count",'
        b'"kind":"counter","request_id":"a1","dimensions":[["Color","red"]]}]}'
    )
    assert (
        encode_bytes(frame)
        == HEADER.pack(b"MS", PROTOCOL_VERSION, Kind.RESULT, 0, len(meta), 2) + meta + b"ok"
    )


def test_result_metrics_round_trip() -> None:
    frame = result_frame(3, [ResponseItem(200, b"ok")], handler_ms=1.5, metrics=[METRIC])
    (decoded,) = decode_all(encode_bytes(frame))
    assert parse_result(decoded) == (3, [ResponseItem(200, b"ok")])
    handler_ms, entries = parse_result_metrics(decoded)
    assert handler_ms == 1.5
    assert entries == [MetricEntry("ItemsSeen", 1, "count", "counter", "a1", [["Color", "red"]])]
    assert parse_result_metrics(result_frame(1, [])) == (None, [])


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"handler_ms": "1"}, "RESULT handler_ms must be a number >= 0, got '1'"),
        ({"handler_ms": -1.0}, "RESULT handler_ms must be a number >= 0, got -1.0"),
        ({"metrics": {}}, "RESULT metrics must be a list, got dict"),
        ({"metrics": [1]}, "RESULT metrics[0] must be an object, got int"),
        ({"metrics": [{"value": 1}]}, "RESULT metrics[0] lacks the required field 'name'"),
        ({"metrics": [{**METRIC, "value": True}]}, "RESULT metrics[0].value must be a number"),
        ({"metrics": [{**METRIC, "kind": "x"}]}, "RESULT metrics[0].kind must be one of"),
        ({"metrics": [{**METRIC, "type": "summary"}]}, "RESULT metrics[0].type must be one of"),
        ({"metrics": [{**METRIC, "dimensions": [["a"]]}]}, "RESULT metrics[0].dimensions"),
    ],
)
def test_result_metrics_errors_name_the_field(meta: dict, message: str) -> None:
    frame = Frame(Kind.RESULT, {"batch_id": 1, "responses": [], **meta})
    with pytest.raises(ProtocolError) as info:
        parse_result_metrics(frame)
    assert str(info.value).startswith(message)


# -- CHUNK: pieces of streamed responses ---------------------------------------------------------


def test_chunk_frame_bytes_are_exact() -> None:
    frame = chunk_frame(7, [ChunkItem(0, b"hi", 200, "text/plain"), ChunkItem(2, b"!")])
    meta = (
        b'{"batch_id":7,"chunks":[{"i":0,"size":2,"status":200,"content_type":"text/plain",'
        b'"headers":[]},{"i":2,"size":1}]}'
    )
    header = HEADER.pack(b"MS", 6, 9, 0, len(meta), 3)
    assert header[:4] == b"MS\x06\x09"
    assert encode_bytes(frame) == header + meta + b"hi!"


def test_chunk_round_trips_with_first_and_later_chunks() -> None:
    items = [ChunkItem(3, ALL_BYTES, 404, "application/json", [["X-B", "2"]]), ChunkItem(1, b"x")]
    (decoded,) = decode_all(encode_bytes(chunk_frame(11, items)))
    batch_id, got = parse_chunk(decoded)
    assert batch_id == 11
    assert [(c.index, bytes(c.body), c.status, c.content_type, c.headers) for c in got] == [
        (3, ALL_BYTES, 404, "application/json", [["X-B", "2"]]),
        (1, b"x", 0, "", []),
    ]


def test_chunk_split_at_every_offset() -> None:
    frames = [
        chunk_frame(1, [ChunkItem(0, b"a" * 8, 200, "text/plain")]),
        chunk_frame(1, [ChunkItem(0, bytes(range(8)))]),
        result_frame(1, [ResponseItem(200, b"end")]),
    ]
    data = b"".join(encode_bytes(f) for f in frames)
    for i in range(len(data) + 1):
        decoder = Decoder()
        assert decoder.feed(data[:i]) + decoder.feed(data[i:]) == frames, i


CHUNK_ERRORS = [
    (
        "no i",
        Frame(Kind.CHUNK, {"batch_id": 1, "chunks": [{"size": 0}]}),
        "CHUNK chunks[0] lacks the required field 'i'",
    ),
    (
        "i negative",
        Frame(Kind.CHUNK, {"batch_id": 1, "chunks": [{"i": -1, "size": 0}]}),
        "CHUNK chunks[0].i must be a non-negative integer, got -1",
    ),
    (
        "status 700",
        Frame(Kind.CHUNK, {"batch_id": 1, "chunks": [{"i": 0, "size": 0, "status": 700}]}),
        "CHUNK chunks[0].status must be an HTTP status in 100..599, got 700",
    ),
    (
        "sizes",
        Frame(Kind.CHUNK, {"batch_id": 2, "chunks": [{"i": 0, "size": 5}]}, b"abc"),
        "CHUNK 2: chunks sizes add up to 5 bytes but the payload holds 3 bytes",
    ),
    (
        "not a chunk",
        result_frame(1, []),
        "expected a CHUNK frame, got RESULT",
    ),
]


@pytest.mark.parametrize(
    ("frame", "message"), [c[1:] for c in CHUNK_ERRORS], ids=[c[0] for c in CHUNK_ERRORS]
)
def test_chunk_parse_error(frame: Frame, message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_chunk(frame)
    assert str(info.value) == message


def test_chunk_build_error_names_the_field() -> None:
    with pytest.raises(ProtocolError, match=r"CHUNK chunks\[0\].body must be bytes-like, got str"):
        chunk_frame(1, [ChunkItem(0, "text")])  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match=r"CHUNK chunks\[1\].status must be an HTTP status"):
        chunk_frame(1, [ChunkItem(0, b""), ChunkItem(1, b"", 1000)])


@pytest.mark.parametrize(
    ("batch_id", "items", "handler_ms"),
    [
        (1, [ResponseItem(200, b"x", "application/json", [])], 1.234),
        (
            7,
            [
                ResponseItem(
                    404, b"", 'text/plain; charset="utf-8"', [["X-A", 'é"\\\n'], ["b", "c"]]
                ),
                ResponseItem(200, b"yy"),
            ],
            None,
        ),
        (0, [], 0.0),
        (3, [ResponseItem(200, b"x", "a\ud800b", [])], 2.5),  # a lone surrogate: escaped
        (3, [ResponseItem(200, b"x", "ok", [["k", "\u2028\x00"]])], 1e-7),
        (2**32, [ResponseItem(599, b"x" * 3, "", [])], 123456789.123),
    ],
)
def test_result_meta_written_directly_is_the_encoders_bytes(
    batch_id: int, items: list[ResponseItem], handler_ms: float | None
) -> None:
    # result_frame writes the usual RESULT meta itself (the JSON encoder is slow on small
    # dicts): the bytes on the wire must be exactly those of encoding frame.meta.
    frame = result_frame(batch_id, items, handler_ms=handler_ms)
    assert frame.meta_text is not None
    assert encode_bytes(frame) == encode_bytes(replace(frame, meta_text=None))
    (decoded,) = decode_all(encode_bytes(frame))
    assert decoded.meta == frame.meta


def test_result_meta_not_json_is_refused_as_before() -> None:
    frame = result_frame(1, [ResponseItem(200, b"")], handler_ms=float("inf"))
    with pytest.raises(ProtocolError, match="RESULT frame meta is not JSON-serialisable"):
        encode_bytes(frame)


def test_result_json_flag_rides_only_where_set_and_round_trips() -> None:
    """A body the worker encoded as JSON is flagged (``json``: the inference log embeds it
    unchecked); unflagged entries, and so frames of unlogged models, are as before."""
    items = [
        ResponseItem(200, b'{"a":1}', "application/json", [], json_body=True),
        ResponseItem(200, b"{not json", "application/json"),
    ]
    frame = result_frame(3, items, handler_ms=1.5)
    assert frame.meta_text is not None  # the direct writer, flag included
    assert encode_bytes(frame) == encode_bytes(replace(frame, meta_text=None))
    assert [e.get("json") for e in frame.meta["responses"]] == [True, None]
    (decoded,) = decode_all(encode_bytes(frame))
    assert [i.json_body for i in parse_result(decoded)[1]] == [True, False]
    # the checked path (a tuple of header pairs) carries it too
    checked = result_frame(4, [replace(items[0], headers=[("X-A", "b")])])  # type: ignore[list-item]
    (decoded,) = decode_all(encode_bytes(checked))
    assert parse_result(decoded)[1][0].json_body is True
    # only ``true`` counts
    odd = Frame(Kind.RESULT, {"batch_id": 1, "responses": [
        {"status": 200, "content_type": "", "headers": [], "size": 0, "json": 1}]})  # fmt: skip
    assert parse_result(odd)[1][0].json_body is False
    assert "json" not in result_frame(5, items[1:]).meta["responses"][0]


def test_a_chunk_in_the_middle_of_a_step_names_its_request_among_the_steps() -> None:
    frame = chunk_frame(4, [ChunkItem(1, b"part", 200, "text/plain")])
    frame.meta["members"] = [[3, 0], [5, 2]]
    (got,) = decode_all(encode_bytes(frame))
    members, chunks = protocol.parse_step_chunk(got)
    assert members == [(3, 0), (5, 2)]
    assert (chunks[0].index, bytes(chunks[0].body)) == (1, b"part")
    frame.meta["members"] = [[3, 0]]
    with pytest.raises(ProtocolError, match=r"^CHUNK for request 1 of a step of 1 requests$"):
        protocol.parse_step_chunk(frame)
    del frame.meta["members"]
    with pytest.raises(ProtocolError, match=r"^CHUNK members must be a list of \[batch_id"):
        protocol.parse_step_chunk(frame)
