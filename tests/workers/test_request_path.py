"""What the worker's per-request path skips when a request does not use it (issue 27), and that
the skipped work still happens for the requests that do: trace headers read from a packed BATCH
entry without splitting it, per-request context state made only when a handler asks, and the
JSON encoder that checks for cycles only when a cycle is there."""

from __future__ import annotations

import pytest

from mserve_worker import tracing
from mserve_worker.context import Context
from mserve_worker.payload import PayloadError, encode_output
from mserve_worker.protocol import RequestItem, batch_frame, parse_batch

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _packed(*pairs: tuple[str, str]) -> RequestItem:
    """A request as the worker reads it from a packed BATCH entry (headers not yet split)."""
    item = RequestItem("r-1", "application/json", [list(p) for p in pairs], b"{}")
    _, (parsed,) = parse_batch(batch_frame(1, [item], check=False))
    return parsed


@pytest.mark.parametrize(
    ("pairs", "traced"),
    [
        ((), False),
        ((("Host", "h"),), False),
        ((("Host", "h"), ("traceparent", TRACEPARENT)), True),
        ((("traceparent", TRACEPARENT),), True),
        ((("traceparent", TRACEPARENT), ("Host", "h")), False),  # the server appends it last
        ((("Traceparent", TRACEPARENT),), False),  # a client's, not the server's
        ((("x-traceparent", "v"),), False),
        ((("Host", "traceparent"),), False),  # a value, not a name
    ],
)
def test_the_servers_trace_header_is_found_in_a_packed_entry_as_in_split_headers(
    pairs: tuple[tuple[str, str], ...], traced: bool
) -> None:
    packed = _packed(*pairs)
    assert tracing.traced_by_server([packed]) is traced
    split = RequestItem("r-1", "", [list(p) for p in pairs], b"")
    assert tracing.traced_by_server([split]) is traced


def test_a_clients_trace_context_is_read_in_any_case_from_a_packed_entry() -> None:
    item = _packed(("Host", "h"), ("TraceParent", TRACEPARENT), ("TRACESTATE", "k=v"))
    assert tracing.header(item, "traceparent") == TRACEPARENT
    assert tracing.header(item, "tracestate") == "k=v"
    assert tracing.header(_packed(("Host", "h")), "traceparent") is None
    # a name inside a value only sends it to the full look, which finds no such header
    assert tracing.header(_packed(("X-Note", "traceparent")), "traceparent") is None


def _context() -> Context:
    return Context("m", "/tmp", {}, 4, None, "mserve", "")


def test_per_request_state_is_made_when_read_and_forgotten_by_the_next_batch() -> None:
    ctx = _context()
    ctx.start_batch([_packed(("X-Id", "7")), RequestItem("r-2", "", [], b"")])
    assert ctx._touched(0) is None  # nothing read or set: the runtime answers 200, no headers
    assert ctx.request_ids == {0: "r-1", 1: "r-2"}
    assert ctx.get_request_header(0, "x-id") == "7"
    ctx.set_response_status(201, "made", idx=1)
    assert ctx._touched(1).get_response_status_code() == 201
    ctx.start_batch([RequestItem("r-3", "", [], b"")])
    assert ctx._touched(0) is None
    assert ctx.request_ids == {0: "r-3"}
    assert ctx.get_response_status(0) == (200, "")


def test_a_metric_names_its_request_of_the_current_batch() -> None:
    ctx = _context()
    ctx.start_batch([RequestItem("a", "", [], b""), RequestItem("b", "", [], b"")])
    ctx.metrics.add_counter("hits", 1, idx=1)
    ctx.start_batch([RequestItem("c", "", [], b"")])
    ctx.metrics.add_counter("hits", 2, idx=0)
    with pytest.raises(IndexError, match=r"idx 1 is not a request of this batch \(batch has 1"):
        ctx.metrics.add_counter("hits", 3, idx=1)
    assert [(m["value"], m["request_id"]) for m in ctx.metrics.drain()] == [(1, "b"), (2, "c")]


def test_an_output_with_a_cycle_is_refused_in_words_and_deep_plain_output_still_encodes() -> None:
    looped: list = []
    looped.append(looped)
    with pytest.raises(PayloadError, match="cannot be sent as JSON: Circular reference detected"):
        encode_output({"out": looped})
    deep: list = []
    for _ in range(200):
        deep = [deep]
    body, content_type = encode_output(deep)
    assert body == b"[" * 201 + b"]" * 201
    assert content_type == "application/json"


def test_content_types_are_parsed_once_each_and_their_memory_is_bounded() -> None:
    from mserve_worker import payload

    sent = "application/json; charset=utf-16"
    body = '{"x": "é"}'.encode("utf-16")
    for _ in range(2):  # the second is answered from what the first parsed
        assert payload.decode_request(sent, (), body, {}) == {"body": {"x": "é"}}
    assert payload.decode_request("text/plain; charset=latin-1", (), b"\xe9", {}) == {"body": "é"}
    with pytest.raises(PayloadError, match="unknown charset 'nope' in Content-Type"):
        payload.decode_request("application/json; charset=nope", (), b"{}", {})
    for i in range(3 * payload._PARSED_TYPES_KEPT):  # clients choose them: no unbounded growth
        assert payload.decode_request(f"application/x-{i}+json", (), b"[1]", {}) == {"body": [1]}
    assert len(payload._PARSED_TYPES) <= payload._PARSED_TYPES_KEPT
