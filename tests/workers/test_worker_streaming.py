"""Streaming inside the worker: the runtime driven over its socket (CHUNK frames, then the RESULT
that closes them), and the error messages of send_intermediate_predict_response."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mserve_worker import protocol, streaming
from mserve_worker.context import Context
from mserve_worker.protocol import STREAM_FAILED_HEADER, Frame, Kind, RequestItem
from tests.workers.test_runtime import HANDLERS, Peer, _plain_copy, _pythons


@pytest.fixture(params=_pythons(), ids=lambda p: "this-python" if p == sys.executable else "3.8")
def worker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Peer, str]]:
    """A real worker on the plain runtime copy; yields the peer and the handler to load."""
    lib = _plain_copy(tmp_path)
    parent, child = socket.socketpair()
    boot = (
        "import sys, runpy; sys.path.insert(0, sys.argv.pop(1));"
        " runpy.run_module('mserve_worker.runtime', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [request.param, "-I", "-u", "-c", boot, str(lib), "--fd", str(child.fileno())],
        cwd=tmp_path, pass_fds=(child.fileno(),), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    child.close()
    peer = Peer(parent)
    assert peer.receive().kind == Kind.HELLO
    try:
        yield peer, request.param
    finally:
        parent.close()
        assert proc.wait(timeout=20) == 0


def load(peer: Peer, handler: str, batch_size: int = 4) -> None:
    init = {"model_name": "s", "model_dir": str(HANDLERS / "streaming"), "handler": handler,
            "manifest": {"model": {"modelName": "s"}}, "batch_size": batch_size, "gpu_id": None}  # fmt: skip
    peer.send(Frame(Kind.INIT, init))
    ready = peer.receive()
    assert ready.kind == Kind.READY, ready.meta


def request(rid: str, **spec: object) -> RequestItem:
    return RequestItem(rid, "application/json", [], json.dumps(spec).encode())


def until_result(peer: Peer) -> tuple[list[Frame], Frame]:
    chunks = []
    while (frame := peer.receive()).kind == Kind.CHUNK:
        chunks.append(frame)
    return chunks, frame


def test_send_intermediate_sends_chunks_with_the_head_once_then_the_result_closes(
    worker: tuple[Peer, str],
) -> None:
    peer, _ = worker
    load(peer, "ts_stream:handle")
    peer.send(protocol.batch_frame(5, [request("r1", name="a", parts=2, status=201,
                                               header="h"), request("r2", name="b", parts=1)]))  # fmt: skip
    chunks, result = until_result(peer)
    parsed = [protocol.parse_chunk(f) for f in chunks]
    assert [batch_id for batch_id, _ in parsed] == [5, 5]
    first, second = (items for _, items in parsed)
    assert [(c.index, bytes(c.body), c.status, c.headers) for c in first] == [
        (0, b"a:0;", 201, [["X-Stream", "h"]]),
        (1, b"b:0;", 200, []),
    ]
    assert first[0].content_type == "text/plain; charset=utf-8"
    assert [(c.index, bytes(c.body), c.status) for c in second] == [(0, b"a:1;", 0)]
    batch_id, responses = protocol.parse_result(result)
    assert batch_id == 5 and [bytes(r.body) for r in responses] == [b"a:end", b"b:end"]


def test_a_generator_that_fails_breaks_only_its_own_stream(worker: tuple[Peer, str]) -> None:
    peer, _ = worker
    load(peer, "gen_stream:handle")
    peer.send(protocol.batch_frame(1, [request("ok", name="ok", parts=3),
                                       request("bad", name="bad", parts=3, fail_after=1)]))  # fmt: skip
    chunks, result = until_result(peer)
    sent = [(c.index, bytes(c.body)) for f in chunks for c in protocol.parse_chunk(f)[1]]
    assert sent == [(0, b"ok:0;"), (1, b"bad:0;"), (0, b"ok:1;"), (0, b"ok:2;")]
    ok, bad = protocol.parse_result(result)[1]
    assert (ok.status, bytes(ok.body), ok.headers) == (200, b"", [])
    assert bad.status == 500
    assert bad.headers == [[STREAM_FAILED_HEADER, "RuntimeError: bad failed after 1 parts"]]
    # a failure before the first chunk is an ordinary answer, with no stream to break
    peer.send(protocol.batch_frame(2, [request("early", name="e", parts=2, fail_after=0)]))
    chunks, result = until_result(peer)
    (early,) = protocol.parse_result(result)[1]
    assert chunks == [] and early.status == 500 and early.headers == []
    assert bytes(early.body) == b"RuntimeError: e failed after 0 parts"


def test_a_cancel_for_the_running_batch_stops_a_generator(worker: tuple[Peer, str]) -> None:
    peer, _ = worker
    load(peer, "gen_stream:handle")
    peer.send(protocol.batch_frame(3, [request("r", name="r", parts=500, sleep=0.01)]))
    assert peer.receive().kind == Kind.CHUNK
    started = time.monotonic()
    peer.send(protocol.cancel_frame(3, ["r"]))
    chunks, result = until_result(peer)
    assert result.kind == Kind.RESULT and len(chunks) < 100
    assert time.monotonic() - started < 2  # 500 parts would take 5 s


def test_send_intermediate_outside_a_worker_or_a_handler_call_says_so() -> None:
    context = Context("m", ".", {}, 1, None, "mserve", "")
    with pytest.raises(RuntimeError) as info:
        streaming.send_intermediate_predict_response(["x"], {0: "r"}, "", 200, context)
    assert str(info.value) == (
        "send_intermediate_predict_response needs an mserve worker: it was called outside one"
    )
    sent: list[Frame] = []
    stream = streaming.Stream(sent.append)
    streaming.install(stream, context)
    try:
        with pytest.raises(RuntimeError) as info:
            streaming.send_intermediate_predict_response(["x"], {0: "r"}, "", 200, context)
        assert str(info.value).startswith(
            "send_intermediate_predict_response was called outside a handler call (after the"
            " batch was answered, or from a thread that outlived it)"
        )
        context.start_batch([RequestItem("r", "", [], b"")])
        stream.reset(9)
        stream.begin([0], context)
        with pytest.raises(IndexError) as index:
            streaming.send_intermediate_predict_response(["x", "y"], {1: "r"}, "", 200, context)
        assert str(index.value) == (
            "streamed response for request index 1: the batch has 1 request (valid: 0 to 0)"
        )
        streaming.send_intermediate_predict_response(None, {0: "r"}, "", 200, context)
        (item,) = protocol.parse_chunk(sent[0])[1]
        assert bytes(item.body) == b"error"  # TorchServe's body when ret is None
    finally:
        streaming._current = None
