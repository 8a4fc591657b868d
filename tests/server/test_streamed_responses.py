"""Streamed responses end to end: real server, real workers, chunks read off a raw socket.

Fixture handlers: tests/handlers/streaming (TorchServe's send_intermediate_predict_response from
both of its import paths, and generators returned per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import socket
import time
import urllib.request
from functools import partial
from typing import Any

import psutil
import pytest

from tests.server.conftest import Server, concurrently, wait_until


class Incomplete(Exception):
    """The connection closed before the terminating zero-length chunk."""


class RawStream:
    """One POST on its own connection, its answer read chunk by chunk as it arrives."""

    def __init__(self, server: Server, model: str, body: dict[str, Any], *,
                 version: str = "1.1", timeout_s: float = 30.0,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        host, port = server.status["inference"].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        data = json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.sent_at = time.monotonic()
        self.sock.sendall(
            f"POST /predictions/{model} HTTP/{version}\r\nHost: x\r\n{extra}"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        self.buf = b""
        head = self._until(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        self.headers = {k.lower(): v for k, _, v in (x.partition(": ") for x in lines[1:])}
        self.head_at = time.monotonic()

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise Incomplete(self.buf)
        self.buf += data

    def _until(self, mark: bytes) -> bytes:
        while mark not in self.buf:
            self._fill()
        out, _, self.buf = self.buf.partition(mark)
        return out

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def next_chunk(self) -> bytes | None:
        """The next chunk's bytes, None at the terminating chunk."""
        size = int(self._until(b"\r\n"), 16)
        if size == 0:
            self._until(b"\r\n")
            return None
        data = self._exactly(size)
        assert self._exactly(2) == b"\r\n"
        return data

    def chunks(self) -> list[bytes]:
        out = []
        while (chunk := self.next_chunk()) is not None:
            out.append(chunk)
        return out

    def rest(self) -> bytes:
        """Everything until the server closes (HTTP/1.0)."""
        while True:
            try:
                self._fill()
            except Incomplete:
                return self.buf

    def close(self) -> None:
        self.sock.close()


def stream_all(server: Server, model: str, body: dict[str, Any]) -> tuple[RawStream, list[bytes]]:
    stream = RawStream(server, model, body)
    try:
        return stream, stream.chunks()
    finally:
        stream.close()


@pytest.fixture
def ts_server(make_archive, start_server) -> Server:
    make_archive("streaming", "ts_stream:handle", "ts")
    make_archive("streaming", "gen_stream:handle", "gen")
    make_archive("streaming", "cls_stream:StreamingHandler", "cls")
    return start_server("ts=ts.mar", "gen=gen.mar", "cls=cls.mar")


def test_send_intermediate_predict_response_streams_chunks_then_the_returned_last_one(
    ts_server,
) -> None:
    stream, chunks = stream_all(ts_server, "ts", {"name": "a", "parts": 3})
    assert stream.status == 200
    assert stream.headers["transfer-encoding"] == "chunked"
    assert "content-length" not in stream.headers
    assert stream.headers["content-type"].startswith("text/plain")
    assert chunks == [b"a:0;", b"a:1;", b"a:2;", b"a:end"]
    # TorchServe sends ts_stream_next with every chunk; no internal header reaches a client here
    assert not [k for k in stream.headers if "stream" in k or k.startswith("x-mserve")]


def test_the_first_chunk_arrives_while_the_handler_still_runs(ts_server) -> None:
    stream = RawStream(ts_server, "ts", {"name": "slow", "parts": 3, "sleep": 1.0})
    try:
        first = stream.next_chunk()
        first_at = time.monotonic()
        rest = stream.chunks()
        last_at = time.monotonic()
    finally:
        stream.close()
    assert first == b"slow:0;" and rest == [b"slow:1;", b"slow:2;", b"slow:end"]
    # the handler sleeps 2 s in all, between parts: the first chunk came long before its end
    assert first_at - stream.sent_at < 1.0, f"first chunk after {first_at - stream.sent_at:.2f} s"
    assert last_at - first_at > 1.5


def test_status_and_headers_come_from_the_context_when_the_first_chunk_is_sent(
    ts_server,
) -> None:
    stream, chunks = stream_all(ts_server, "ts", {"name": "h", "parts": 1, "status": 206,
                                                  "header": "yes"})  # fmt: skip
    assert stream.status == 206 and stream.headers["x-stream"] == "yes"
    assert "x-request-id" in stream.headers
    assert chunks == [b"h:0;", b"h:end"]


def test_a_handler_class_streams_through_the_deprecated_import_path(ts_server) -> None:
    stream, chunks = stream_all(ts_server, "cls", {"text": "one two three"})
    assert stream.status == 200
    assert chunks == [b"one ", b"two ", b"three ", b"<eos>"]


@pytest.mark.parametrize("gen", [False, True], ids=["send_intermediate", "generator"])
def test_a_base_handler_subclass_streams_from_inference(gen, make_archive, start_server) -> None:
    make_archive("streaming", "base_stream:WordStreamer", "words")
    server = start_server("words=words.mar")
    stream, chunks = stream_all(server, "words", {"text": "to be or not", "gen": gen})
    assert stream.status == 200 and chunks == [b"to", b"be", b"or", b"not"]


def test_a_handler_may_return_a_generator_per_request(ts_server) -> None:
    stream, chunks = stream_all(ts_server, "gen", {"name": "g", "parts": 4})
    assert stream.status == 200 and stream.headers["transfer-encoding"] == "chunked"
    assert chunks == [b"g:0;", b"g:1;", b"g:2;", b"g:3;"]


def test_the_connection_stays_usable_after_a_stream_and_pipelined_answers_keep_order(
    ts_server,
) -> None:
    host, port = ts_server.status["inference"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Content-Type": "application/json"}
    conn.request("POST", "/predictions/gen", json.dumps({"name": "k", "parts": 3}), headers)
    first = conn.getresponse()
    assert first.read() == b"k:0;k:1;k:2;"  # http.client decodes the chunked body
    conn.request("POST", "/predictions/gen", json.dumps({"pid": True}), headers)
    second = conn.getresponse()
    assert second.status == 200 and json.loads(second.read())["pid"] > 0
    conn.close()
    # pipelined: a slow stream, then a plain request, on one connection, answered in order
    sock = socket.create_connection((host, int(port)), timeout=30)
    # the second (ts, no parts: a plain answer) is ready long before the first ends
    bodies = [json.dumps({"name": "p", "parts": 3, "sleep": 0.2}), json.dumps({"name": "q"})]
    sock.sendall(b"".join(
        f"POST /predictions/{m} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(b)}\r\n\r\n{b}".encode()
        for m, b in zip(["gen", "ts"], bodies, strict=True)
    ))  # fmt: skip
    data = b""
    while not data.endswith(b"q:end"):
        more = sock.recv(65536)
        assert more, data
        data += more
    sock.close()
    streamed, _, plain = data.partition(b"0\r\n\r\nHTTP/1.1 200")
    assert b"transfer-encoding: chunked" in streamed.lower() and streamed.count(b"p:") == 3
    assert b"content-length" in plain.lower()


def test_a_non_streaming_answer_is_unchanged(ts_server) -> None:
    reply = ts_server.predict("gen", {"pid": True})
    assert reply.status == 200 and "Content-Length" in reply.headers
    assert "Transfer-Encoding" not in reply.headers
    assert reply.json()["pid"] > 0


@pytest.mark.parametrize("model", ["ts", "gen"])
def test_each_request_of_a_batch_gets_its_own_stream(model, make_archive, start_server) -> None:
    handler = {"ts": "ts_stream:handle", "gen": "gen_stream:handle"}[model]
    make_archive("streaming", handler, model)
    server = start_server()
    registered = server.manage(
        "POST",
        f"/models?url={model}.mar&batch_size=4&max_batch_delay=2000&batch_wait=fill"
        "&initial_workers=1",
    )
    assert registered.status == 200, registered.body
    names = ["a", "b", "c", "d"]
    results = concurrently(
        *(partial(stream_all, server, model, {"name": n, "parts": 2 + i, "sleep": 0.05})
          for i, n in enumerate(names))
    )  # fmt: skip
    for i, (name, (stream, chunks)) in enumerate(zip(names, results, strict=True)):
        assert stream.status == 200
        expected = [f"{name}:{p};".encode() for p in range(2 + i)]
        assert chunks == ([*expected, f"{name}:end".encode()] if model == "ts" else expected)


@pytest.mark.parametrize("model", ["ts", "gen"])
def test_a_failure_mid_stream_is_visible_and_the_worker_keeps_serving(model, ts_server) -> None:
    pid = ts_server.worker_pids(model)[0]
    stream = RawStream(ts_server, model, {"name": "f", "parts": 5, "fail_after": 2})
    try:
        assert stream.status == 200
        assert stream.next_chunk() == b"f:0;" and stream.next_chunk() == b"f:1;"
        with pytest.raises(Incomplete):  # closed without the terminating chunk
            stream.next_chunk()
    finally:
        stream.close()
    _, chunks = stream_all(ts_server, model, {"name": "next", "parts": 1})
    assert chunks[0] == b"next:0;"
    assert ts_server.worker_pids(model) == [pid]
    log = (ts_server.run_dir / "logs" / "mserve.log").read_text()
    assert "broke after 8 bytes" in log and "f failed after 2 parts" in log


def test_a_prediction_exception_breaks_a_started_stream_and_sets_the_status_before(
    ts_server,
) -> None:
    """Once a chunk went out the status is sent: TorchServe's PredictionException can only end
    the stream broken; raised before the first chunk it answers its own status and message."""
    stream = RawStream(ts_server, "ts", {"name": "p", "parts": 4, "fail_after": 1,
                                         "prediction_error": 429})  # fmt: skip
    try:
        assert stream.status == 200 and stream.next_chunk() == b"p:0;"
        with pytest.raises(Incomplete):  # closed without the terminating chunk
            stream.next_chunk()
    finally:
        stream.close()
    reply = ts_server.predict("ts", {"name": "q", "parts": 2, "fail_after": 0,
                                     "prediction_error": 429})  # fmt: skip
    assert reply.status == 429
    assert reply.json()["message"] == "q refused after 0 parts"


def test_a_failure_before_the_first_chunk_is_an_ordinary_error_answer(ts_server) -> None:
    reply = ts_server.predict("gen", {"name": "early", "parts": 3, "fail_after": 0})
    assert reply.status == 500
    assert "early failed after 0 parts" in reply.body.decode()
    # an error text holding a lone surrogate (here from the body's "\ud800"): UTF-8 has no
    # bytes for it, so it goes out as its escape, and the worker lives on
    pid = ts_server.worker_pids("gen")[0]
    body = b'{"name": "odd\\ud800", "parts": 3, "fail_after": 0}'
    reply = ts_server.predict("gen", body, headers={"Content-Type": "application/json"})
    assert reply.status == 500
    assert "odd\\ud800 failed after 0 parts" in reply.body.decode()
    assert ts_server.worker_pids("gen") == [pid]


def test_an_http_1_0_client_gets_the_whole_answer_with_a_length(ts_server) -> None:
    stream = RawStream(ts_server, "ts", {"name": "old", "parts": 2}, version="1.0")
    try:
        body = stream.rest()
    finally:
        stream.close()
    assert stream.status == 200 and "transfer-encoding" not in stream.headers
    assert body == b"old:0;old:1;old:end"
    assert stream.headers["content-length"] == str(len(body))


def test_an_http_1_0_answer_over_max_response_size_is_refused(make_archive, start_server) -> None:
    make_archive("streaming", "gen_stream:handle", "gen")
    server = start_server("gen=gen.mar", config={"max_response_size_bytes": 100})
    stream = RawStream(server, "gen", {"name": "long", "parts": 50}, version="1.0")
    try:
        body = json.loads(stream.rest())
    finally:
        stream.close()
    assert stream.status == 413
    assert body["message"] == (
        "the streamed response of gen:1.0 is more than max_response_size_bytes=100, too much to"
        " hold for a client that cannot take it as it comes (HTTP/1.0, or behind an earlier"
        " answer on the connection)"
    )
    # an HTTP/1.1 client takes it as it comes: the cap is not for streams
    _, chunks = stream_all(server, "gen", {"name": "long", "parts": 50})
    assert len(chunks) == 50


def test_a_worker_that_sends_a_chunk_for_no_request_is_replaced(ts_server) -> None:
    pid = ts_server.worker_pids("gen")[0]
    reply = ts_server.predict("gen", {"bogus": True})
    assert reply.status == 500
    assert reply.json()["message"].endswith(
        "broke the protocol (CHUNK for request 99 of batch 1, which has 1); killed"
    )
    wait_until(lambda: ts_server.worker_pids("gen") not in ([], [pid]), 30, "a new worker")
    _, chunks = stream_all(ts_server, "gen", {"name": "again", "parts": 1})
    assert chunks == [b"again:0;"]


def test_a_slow_reader_holds_the_handler_back_instead_of_filling_the_server(
    make_archive, start_server
) -> None:
    """40 MB streamed to a client that does not read: the server's memory stays bounded (the
    worker is paused), and the client still gets every byte once it reads."""
    make_archive("streaming", "gen_stream:handle", "gen")
    server = start_server("gen=gen.mar")
    proc = psutil.Process(server.pid)
    before = proc.memory_info().rss
    token = "x" * 65536
    parts = 640
    stream = RawStream(server, "gen", {"name": "big", "parts": parts, "token": token})
    stream.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    try:
        time.sleep(3)  # the handler would be done by now if nothing held it back
        grown = proc.memory_info().rss - before
        assert grown < 16 * 1024 * 1024, f"the server grew by {grown} bytes"
        total = sum(len(c) for c in stream.chunks())
    finally:
        stream.close()
    assert total == parts * len(token)


def test_a_client_that_leaves_mid_stream_stops_its_generator(ts_server) -> None:
    """The generator would run 10 s; the next request on the same (only) worker is answered
    long before that, because the worker closed the generator when the client left."""
    stream = RawStream(ts_server, "gen", {"name": "gone", "parts": 200, "sleep": 0.05})
    assert stream.next_chunk() == b"gone:0;"
    stream.close()
    started = time.monotonic()
    _, chunks = stream_all(ts_server, "gen", {"name": "after", "parts": 2})
    assert chunks == [b"after:0;", b"after:1;"]
    assert time.monotonic() - started < 5


def test_the_response_timeout_ends_a_stream_that_runs_too_long(make_archive, start_server) -> None:
    make_archive("streaming", "gen_stream:handle", "gen")
    server = start_server()
    assert server.manage("POST", "/models?url=gen.mar&response_timeout=1").status == 200
    stream = RawStream(server, "gen", {"name": "t", "parts": 50, "sleep": 0.2})
    try:
        assert stream.next_chunk() == b"t:0;"
        with pytest.raises(Incomplete):
            stream.chunks()
    finally:
        stream.close()
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert "response_timeout_s=1" in log


def test_a_stream_counts_once_in_the_access_log_and_metrics(ts_server) -> None:
    stream_all(ts_server, "ts", {"name": "m", "parts": 3})
    access = ts_server.run_dir / "logs" / "access.log"
    wait_until(lambda: "/predictions/ts" in access.read_text(), 5, "the access log line")
    lines = [line for line in access.read_text().splitlines() if "/predictions/ts" in line]
    assert len(lines) == 1 and '" 200 17 ' in lines[0]  # the body's bytes: 4 + 4 + 4 + 5
    with urllib.request.urlopen(ts_server.url("metrics", "/metrics"), timeout=10) as resp:
        metrics = resp.read().decode()
    assert 'mserve_requests_total{code="200",model="ts",version="1.0"} 1.0' in metrics
    # TorchServe's names count it once too
    assert re.search(
        r'^ts_inference_requests_total\{[^}]*model_name="ts"[^}]*\} 1\.0$', metrics, re.M
    )


# -- ChunkStream as another frontend (gRPC server streaming) would read it ----------------------


def test_a_chunk_stream_reads_as_an_async_iterator_with_back_pressure() -> None:
    from server.errors import HandlerError
    from server.streaming import BACKLOG_BYTES, ChunkStream

    async def scenario() -> None:
        paused: list[str] = []
        stream = ChunkStream(200, "text/plain", [], lambda: paused.append("pause"),
                             lambda: paused.append("resume"))  # fmt: skip
        stream.push(b"early")  # before any reader: held
        got: list[bytes] = []

        async def read() -> None:
            async for chunk in stream.chunks():
                got.append(chunk)
                await asyncio.sleep(0)

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0)
        big = b"x" * (BACKLOG_BYTES + 1)
        stream.push(big)  # more than the reader holds: the worker's channel is paused
        assert paused == ["pause"]
        await asyncio.sleep(0.01)
        assert paused == ["pause", "resume"]  # the reader took it
        stream.finish(b"last")
        await asyncio.wait_for(reader, 5)
        assert got == [b"early", big, b"last"]

        failing = ChunkStream(200, "", [], lambda: None, lambda: None)
        failing.push(b"a")
        failing.fail(HandlerError("handler of m:1 failed mid-stream: boom"))
        seen = []
        with pytest.raises(HandlerError, match="failed mid-stream: boom"):
            async for chunk in failing.chunks():
                seen.append(chunk)
        assert seen == [b"a"]

        cancelled: list[bool] = []
        left = ChunkStream(200, "", [], lambda: None, lambda: None, lambda: cancelled.append(True))
        left.push(b"1")
        async with contextlib.aclosing(left.chunks()) as chunks:
            async for _chunk in chunks:
                break  # the consumer leaves early: the worker is told
        assert cancelled == [True] and left.cancelled

    asyncio.run(scenario())
