"""Packed BATCH entries (protocol 4): ``[id, content_type, size, headers]`` with the headers as
one string, names and values joined by U+007F; the object form for everything else."""

from __future__ import annotations

import json

import pytest

from mserve_worker.protocol import (
    PACK_SEP,
    Decoder,
    Frame,
    Kind,
    ProtocolError,
    RequestItem,
    batch_frame,
    encode_bytes,
    parse_batch,
    parse_result,
)

ODD_HEADERS = [
    ["Host", "127.0.0.1:8080"],
    ["X-Quote", 'a "quoted" \\ value'],
    ["X-Ünï", "値 ß"],
    ["X-Raw", "\udcff\udc80 bytes a client sent"],  # undecodable bytes, as surrogateescape keeps
    ["X-Empty", ""],
    ["X-Trace", "1"],
    ["x-trace", "2"],
]
ITEMS = [
    RequestItem("r-odd", 'text/"plain"', ODD_HEADERS, b"body one"),
    RequestItem("r-empty", "", [], b""),
    RequestItem("r-one", "application/json", [["", ""]], b"{}"),
]


def _round_trip(frame: Frame) -> list[RequestItem]:
    data = encode_bytes(frame)
    for cut in range(len(data) + 1):  # however the stream is cut
        decoder = Decoder()
        frames = decoder.feed(data[:cut]) + decoder.feed(data[cut:])
        assert len(frames) == 1
        batch_id, items = parse_batch(frames[0])
        assert batch_id == 9
    return items


@pytest.mark.parametrize("check", [True, False])
def test_packed_entries_round_trip_odd_headers_and_empty_ones(check: bool) -> None:
    frame = batch_frame(9, ITEMS, check=check)
    assert all(type(entry) is list for entry in frame.meta["requests"])
    items = _round_trip(frame)
    assert [(i.request_id, i.content_type, i.headers, bytes(i.body)) for i in items] == [
        (i.request_id, i.content_type, i.headers, bytes(i.body)) for i in ITEMS
    ]
    assert all(i.params == {} and i.op == "" and i.api == "" for i in items)


def test_the_hot_path_text_is_the_encoders_byte_for_byte() -> None:
    plain = [RequestItem("r1", 'a/"b"\\', [["K", "välue"], ["Q", '"']], b"xy"), ITEMS[1]]
    fast = batch_frame(9, plain, check=False)
    assert fast.meta_text is not None
    encoded = json.dumps(fast.meta, separators=(",", ":"), ensure_ascii=False)
    assert fast.meta_text == encoded
    assert encode_bytes(fast) == encode_bytes(batch_frame(9, plain))


def test_a_header_holding_the_separator_travels_in_the_object_form() -> None:
    item = RequestItem("r", "", [["X-Del", f"a{PACK_SEP}b"], ["K", "v"]], b"!")
    frame = batch_frame(9, [item, ITEMS[1]], check=False)
    assert type(frame.meta["requests"][0]) is dict
    assert type(frame.meta["requests"][1]) is list  # each entry on its own
    items = _round_trip(frame)
    assert items[0].headers == [["X-Del", f"a{PACK_SEP}b"], ["K", "v"]]
    assert items[1].headers == []


def test_requests_with_an_op_api_or_query_keep_the_object_form() -> None:
    items = [
        RequestItem("a", "", [["K", "v"]], b"1", params={"q": "1"}),
        RequestItem("b", "", [["K", "v"]], b"2", op="explain"),
        RequestItem("c", "", [["K", "v"]], b"3", api="v2"),
    ]
    frame = batch_frame(9, items, check=False)
    assert all(type(entry) is dict for entry in frame.meta["requests"])
    assert _round_trip(frame) == items


PACKED_ERRORS = [
    ([["r", "", 0]], b"", "BATCH requests[0] is packed: [id, content_type, size, headers], 4 items, got 3"),
    ([[7, "", 0, ""]], b"", "BATCH requests[0][0] (id) must be a string, got int"),
    ([["r", None, 0, ""]], b"", "BATCH requests[0][1] (content_type) must be a string, got NoneType"),
    ([["r", "", -1, ""]], b"", "BATCH requests[0][2] (size) must be a non-negative integer, got -1"),
    ([["r", "", 0, ["K", "v"]]], b"", "BATCH requests[0][3] (headers) must be a string, got list"),
    ([["r", "", 0, f"K{PACK_SEP}v{PACK_SEP}W"]], b"",
     "BATCH requests[0][3] (headers) must hold names and values joined by U+007F, an even number"
     " of them; got 3"),
    ([["r", "", 2, ""]], b"x", "BATCH 1: requests sizes add up to 2 bytes but the payload holds 1 bytes"),
]  # fmt: skip


@pytest.mark.parametrize(("entries", "payload", "message"), PACKED_ERRORS)
def test_a_bad_packed_entry_is_refused_naming_its_field(
    entries: list[object], payload: bytes, message: str
) -> None:
    frame = Frame(Kind.BATCH, {"batch_id": 1, "requests": entries}, payload)
    (decoded,) = Decoder().feed(encode_bytes(frame))
    with pytest.raises(ProtocolError) as info:
        parse_batch(decoded)
    assert str(info.value) == message


def test_result_entries_are_never_packed() -> None:
    frame = Frame(Kind.RESULT, {"batch_id": 1, "responses": [[200, "", 0, ""]]})
    with pytest.raises(ProtocolError) as info:
        parse_result(frame)
    assert str(info.value) == "RESULT meta 'responses' must be a list of objects"
