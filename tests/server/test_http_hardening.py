"""Abuse of the HTTP layer through a real server and raw sockets: oversized bodies that the
client is still sending, request smuggling, malformed framing, slow and flooding clients.

Each case must end in a clean refusal (a 4xx/5xx-free answer and a close, or a close), must
never run a request smuggled inside another, and must leave the server serving everyone else.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import requests

from server.http.linger import LINGER_BYTES, LINGER_IDLE_S, LINGER_S
from tests.server.conftest import Server
from tests.server.conftest import http as http_call

OPEN = {"disable_token_authorization": True, "enable_model_api": True}
MIB = 1024 * 1024


def _address(server: Server) -> tuple[str, int]:
    host, port = server.status["inference"].rsplit(":", 1)
    return host, int(port)


def _connect(server: Server, timeout: float = 10) -> socket.socket:
    return socket.create_connection(_address(server), timeout=timeout)


def _read_all(sock: socket.socket, within_s: float = 10) -> tuple[bytes, str]:
    """Everything the server sends until it closes: (bytes, how it ended: "eof", "reset" or
    "open" when it was still open after ``within_s``)."""
    deadline = time.monotonic() + within_s
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return data, "open"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data, "open"
        except ConnectionResetError:
            return data, "reset"
        if not chunk:
            return data, "eof"
        data += chunk


def _answers(data: bytes) -> list[tuple[int, bytes]]:
    """The (status, body) of each Content-Length framed answer in ``data``."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"a truncated answer: {data!r}"
        status_line, *lines = head.decode("latin-1").split("\r\n")
        fields = dict(line.lower().split(": ", 1) for line in lines)
        length = int(fields.get("content-length", "0"))
        out.append((int(status_line.split()[1]), rest[:length]))
        data = rest[length:]
    return out


def _still_serving(server: Server) -> None:
    reply = server.predict("probe", {"tag": "after"})
    assert reply.status == 200, reply.body
    assert reply.json()["body"] == {"tag": "after"}


@pytest.fixture
def server(make_archive, start_server) -> Server:
    make_archive("probe", "probe:handle", "probe")
    return start_server(
        "probe=probe.mar",
        config={**OPEN, "max_request_size_bytes": MIB, "read_timeout_s": 2},
    )


# --- 413 while the client is still sending ----------------------------------------------------


def test_urllib_reads_the_413_of_a_body_it_is_still_sending(server: Server) -> None:
    """Python's clients send the whole body before they read: the server must keep reading
    (and dropping) it, or the kernel resets the connection and the answer is lost."""
    url = server.url("inference", "/predictions/probe")
    request = urllib.request.Request(url, data=b"x" * (4 * MIB), method="POST")
    request.add_header("Content-Type", "application/octet-stream")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 413
    body = json.loads(caught.value.read())
    assert body == {
        "code": 413,
        "type": "RequestTooLargeException",
        "message": f"request body is {4 * MIB} bytes, more than max_request_size_bytes={MIB}",
    }
    _still_serving(server)


def test_http_client_reads_the_413_of_a_chunked_body(server: Server) -> None:
    """Chunked: the limit is passed while the body arrives; the answer still reaches a client
    that reads only once it has sent everything."""
    conn = http.client.HTTPConnection(*_address(server), timeout=30)
    chunks = (b"y" * 65536 for _ in range(64))  # 4 MiB, chunked (no length known)
    conn.request("POST", "/predictions/probe", body=chunks, encode_chunked=True,
                 headers={"Content-Type": "application/octet-stream"})  # fmt: skip
    reply = conn.getresponse()
    assert reply.status == 413
    assert reply.getheader("Connection") == "close"
    assert json.loads(reply.read())["message"] == (
        f"request body is larger than max_request_size_bytes={MIB}"
    )
    conn.close()
    _still_serving(server)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_declared_body_over_the_byte_bound_is_not_waited_for(server: Server) -> None:
    """Dropping it would be cut off at LINGER_BYTES anyway: the 413 goes out and the
    connection closes at once (a client that reads while it sends, as curl does, gets it)."""
    length = LINGER_BYTES + 1
    with _connect(server) as sock:
        sock.sendall(b"POST /predictions/probe HTTP/1.1\r\nHost: t\r\n"
                     + f"Content-Length: {length}\r\n\r\n".encode())  # fmt: skip
        started = time.monotonic()
        data, ended = _read_all(sock, 5)
        assert ended in ("eof", "reset") and time.monotonic() - started < 2
        [(status, body)] = _answers(data)
        assert status == 413 and json.loads(body) == _too_large(length, MIB)
    _still_serving(server)


def test_the_413_goes_out_with_a_half_close_and_the_rest_of_the_body_is_read(
    server: Server,
) -> None:
    """The answer arrives (and then EOF) while the client has not finished sending; once the
    rest comes in, the connection closes without a reset."""
    with _connect(server) as sock:
        sock.sendall(b"POST /predictions/probe HTTP/1.1\r\nHost: t\r\n"
                     + f"Content-Length: {2 * MIB}\r\n\r\n".encode())  # fmt: skip
        data, ended = _read_all(sock, 3)
        assert ended == "eof", "no half-close after the answer"
        [(status, _)] = _answers(data)
        assert status == 413
        sock.sendall(b"w" * (2 * MIB))  # the server still reads: no EPIPE, no reset
        sock.shutdown(socket.SHUT_WR)
        assert _read_all(sock, 5) == (b"", "eof")
    _still_serving(server)


# --- lingering close: every client reads its 413, within bounds ---------------------------------


def _too_large(length: int, limit: int) -> dict[str, object]:
    """TorchServe's error body for a declared body over the limit."""
    return {
        "code": 413,
        "type": "RequestTooLargeException",
        "message": f"request body is {length} bytes, more than max_request_size_bytes={limit}",
    }


def test_urllib_and_requests_read_the_413_of_a_64_mib_body(make_archive, start_server) -> None:
    """Far over the default limit (6.5 MB): both clients send the whole body before they read,
    so the server reads and drops all of it before it closes; neither sees a reset. A few
    rounds each, since a reset depends on timing."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config=OPEN)
    url = server.url("inference", "/predictions/probe")
    body = b"x" * (64 * MIB)
    expected = _too_large(len(body), 6_553_500)
    headers = {"Content-Type": "application/octet-stream"}
    for _ in range(3):
        request = urllib.request.Request(url, data=body, method="POST", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        assert caught.value.code == 413
        assert json.loads(caught.value.read()) == expected
        reply = requests.post(url, data=body, headers=headers, timeout=60)
        assert reply.status_code == 413
        assert reply.headers["Connection"] == "close"
        assert reply.json() == expected
    _still_serving(server)


def test_a_client_sending_on_and_on_is_cut_off_at_the_byte_bound(server: Server) -> None:
    """A refused chunked body sent as fast as it goes: dropped as it comes, and cut off at
    LINGER_BYTES (or LINGER_S, on a machine too busy to send that much in time); the server
    holds none of it."""
    before = _rss_bytes(server.pid)
    with _connect(server) as sock:
        sock.sendall(b"POST /predictions/probe HTTP/1.1\r\nHost: t\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        chunk = b"100000\r\n" + b"z" * MIB + b"\r\n"
        sent, cut = 0, False
        started = time.monotonic()
        while sent < 3 * LINGER_BYTES and time.monotonic() - started < LINGER_S + 20:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            sent += len(chunk)
        took = time.monotonic() - started
    assert cut, f"sent {sent} bytes in {took:.1f} s and the server still read them"
    assert sent < LINGER_BYTES + 64 * MIB, sent  # the bound plus what socket buffers hold
    assert took < LINGER_S + 3, took
    assert _rss_bytes(server.pid) - before < 16 * MIB
    _still_serving(server)


def test_a_slow_sender_is_cut_off_at_the_time_bound(server: Server) -> None:
    """A client that keeps sending a little at a time (never idle for LINGER_IDLE_S) gets its
    413 at once and is cut off LINGER_S later, not held for as long as it likes (nor cut
    at read_timeout_s, 2 s here: lingering has bounds of its own)."""
    with _connect(server) as sock:
        sock.sendall(b"POST /predictions/probe HTTP/1.1\r\nHost: t\r\n"
                     + f"Content-Length: {100 * MIB}\r\n\r\n".encode())  # fmt: skip
        data, ended = _read_all(sock, 5)
        started = time.monotonic()
        assert ended == "eof"
        [(status, body)] = _answers(data)
        assert status == 413 and json.loads(body) == _too_large(100 * MIB, MIB)
        cut = False
        while time.monotonic() - started < LINGER_S + 10:
            try:
                sock.sendall(b"s" * 16384)
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            time.sleep(0.25)
        took = time.monotonic() - started
    assert cut, "a slow sender was never cut off"
    assert LINGER_S - 0.5 < took < LINGER_S + 3, took
    _still_serving(server)


def test_a_client_that_stops_sending_is_closed_after_the_idle_bound(server: Server) -> None:
    with _connect(server) as sock:
        sock.sendall(b"POST /predictions/probe HTTP/1.1\r\nHost: t\r\n"
                     + f"Content-Length: {4 * MIB}\r\n\r\n".encode() + b"v" * MIB)  # fmt: skip
        data, ended = _read_all(sock, 5)
        assert ended == "eof"
        [(status, _)] = _answers(data)
        assert status == 413
        time.sleep(LINGER_IDLE_S + 1)
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            for _ in range(40):  # the closed socket answers what comes next with a reset
                sock.sendall(b"v" * 65536)
                time.sleep(0.05)
    _still_serving(server)


# --- request smuggling and malformed framing ----------------------------------------------------


def _smuggled(marker: Path) -> bytes:
    """A complete second request that leaves a trace if it is ever run."""
    body = json.dumps({"cmd": "touch", "path": str(marker)}).encode()
    return (b"POST /predictions/probe HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip


def _post(headers: bytes, body: bytes = b"", version: bytes = b"1.1") -> bytes:
    return (b"POST /predictions/probe HTTP/" + version + b"\r\nHost: t\r\n"
            b"Content-Type: application/json\r\n" + headers + b"\r\n" + body)  # fmt: skip


# (id, request bytes, expected status or None for "closed without an answer", message part);
# "{s}" in a request is replaced by a smuggled request, "{n}" by its length.
CASES = [
    ("content-length and transfer-encoding", _post(
        b"Content-Length: {n}\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n{s}"), 400,
     "Transfer-Encoding can't be present with Content-Length"),
    ("transfer-encoding and content-length", _post(
        b"Transfer-Encoding: chunked\r\nContent-Length: {n}\r\n", b"0\r\n\r\n{s}"), 400,
     "Content-Length can't be present with Transfer-Encoding"),
    ("two different content-lengths", _post(
        b"Content-Length: 0\r\nContent-Length: {n}\r\n", b"{s}"), 400, "Duplicate Content-Length"),
    ("the same content-length twice", _post(
        b"Content-Length: {n}\r\nContent-Length: {n}\r\n", b"{s}"), 400,
     "Duplicate Content-Length"),
    ("a content-length list", _post(b"Content-Length: 0, {n}\r\n", b"{s}"), 400,
     "Invalid character in Content-Length"),
    ("a signed content-length", _post(b"Content-Length: +0\r\n", b"{s}"), 400,
     "Invalid character in Content-Length"),
    ("a negative content-length", _post(b"Content-Length: -1\r\n", b"{s}"), 400,
     "Invalid character in Content-Length"),
    ("an overflowing content-length", _post(b"Content-Length: 99999999999999999999999\r\n"),
     400, "Content-Length overflow"),
    ("a space before the colon", _post(b"Content-Length : {n}\r\n", b"{s}"), 400,
     "Invalid header field char"),
    ("transfer-encoding twice", _post(
        b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n", b"0\r\n\r\n{s}"), 400,
     "Invalid `Transfer-Encoding` header value"),
    ("chunked, then another coding", _post(
        b"Transfer-Encoding: chunked, identity\r\n", b"0\r\n\r\n{s}"), 400,
     "Invalid `Transfer-Encoding` header value"),
    ("a coding before chunked", _post(
        b"Transfer-Encoding: gzip, chunked\r\n", b"0\r\n\r\n{s}"), 501,
     "Transfer-Encoding 'gzip, chunked' is not supported; only chunked is"),
    ("an unknown coding", _post(b"Transfer-Encoding: xchunked\r\n", b"0\r\n\r\n{s}"), 501,
     "Transfer-Encoding 'xchunked' is not supported; only chunked is"),
    ("transfer-encoding in HTTP/1.0", _post(
        b"Transfer-Encoding: chunked\r\n", b"0\r\n\r\n{s}", b"1.0"), 400,
     "Transfer-Encoding is not allowed in an HTTP/1.0 request"),
    ("a folded transfer-encoding", _post(
        b"Transfer-Encoding:\r\n chunked\r\n", b"0\r\n\r\n{s}"), 400, "Invalid header value char"),
    ("a non-hex chunk size", _post(b"Transfer-Encoding: chunked\r\n", b"zz\r\n{s}\r\n0\r\n\r\n"),
     400, "Invalid character in chunk size"),
    ("a negative chunk size", _post(b"Transfer-Encoding: chunked\r\n", b"-1\r\n{s}\r\n0\r\n\r\n"),
     400, "Invalid character in chunk size"),
    ("an overflowing chunk size", _post(
        b"Transfer-Encoding: chunked\r\n", b"1" + b"0" * 20 + b"\r\n{s}\r\n0\r\n\r\n"), 400,
     "Chunk size overflow"),
    ("a 0x chunk size", _post(b"Transfer-Encoding: chunked\r\n", b"0x5\r\n{s}\r\n0\r\n\r\n"),
     400, "Invalid character in chunk size"),
    ("chunk data longer than its size", _post(
        b"Transfer-Encoding: chunked\r\n", b"2\r\n{}{s}\r\n0\r\n\r\n"), 400,
     "Expected LF after chunk data"),
    ("a content-length in the trailer", _post(
        b"Transfer-Encoding: chunked\r\n", b"2\r\n{}\r\n0\r\nContent-Length: {n}\r\n\r\n{s}"),
     400, "Content-Length can't be present with Transfer-Encoding"),
    ("obsolete line folding", _post(b"X-Folded: a\r\n b\r\nContent-Length: 2\r\n", b"{}{s}"),
     400, "Unexpected whitespace after header value"),
    ("NUL in a header name", _post(b"X-\x00A: a\r\nContent-Length: 2\r\n", b"{}{s}"), 400,
     "Invalid header token"),
    ("NUL in a header value", _post(b"X-A: a\x00b\r\nContent-Length: 2\r\n", b"{}{s}"), 400,
     "Invalid header value char"),
    ("bare CR in a header name", _post(b"X-\rA: a\r\nContent-Length: 2\r\n", b"{}{s}"), 400,
     "Invalid header token"),
    ("bare CR in a header value", _post(b"X-A: a\rb\r\nContent-Length: 2\r\n", b"{}{s}"), 400,
     "Missing expected LF after header value"),
    ("bare LF in a header value", _post(b"X-A: a\nContent-Length: 2\r\n", b"{}{s}"), 400,
     "Missing expected CR after header value"),
    ("LF-only line endings", b"POST /predictions/probe HTTP/1.1\nHost: t\nContent-Length: 2\n\n"
     b"{}{s}", 400, "Expected CRLF after version"),
    ("a chunk size ended by a bare LF", _post(
        b"Transfer-Encoding: chunked\r\n", b"2\n{}\r\n0\r\n\r\n{s}"), 400,
     "Missing expected CR after chunk size"),
    ("an upgrade with a body", _post(
        b"Connection: Upgrade\r\nUpgrade: h2c\r\nContent-Length: {n}\r\n", b"{s}"), 400,
     "protocol upgrades (WebSocket, h2c) are not supported, nor CONNECT"),
    ("CONNECT", b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: t\r\n\r\n{s}", 400,
     "protocol upgrades (WebSocket, h2c) are not supported, nor CONNECT"),
    ("HTTP/2.0 in a request line", _post(b"Content-Length: {n}\r\n", b"{s}", b"2.0"), 505,
     "HTTP/2.0 is not supported; use HTTP/1.1"),
    ("HTTP/1.2", _post(b"Content-Length: 2\r\n", b"{}{s}", b"1.2"), 400, "Invalid HTTP version"),
    ("a space in the target", b"POST /predictions/probe x HTTP/1.1\r\nHost: t\r\n\r\n{s}", 400,
     "malformed HTTP request"),
    ("a NUL in the target", b"POST /predictions/\x00probe HTTP/1.1\r\nHost: t\r\n\r\n{s}", 400,
     "Invalid char in url path"),
    ("a lower-case method", b"post /predictions/probe HTTP/1.1\r\nHost: t\r\n\r\n{s}", 400,
     "Invalid method encountered"),
    ("an oversized head", _post(b"X-Big: " + b"b" * 70_000 + b"\r\nContent-Length: 2\r\n",
                                b"{}{s}"), 431,
     "request line and headers are larger than 65536 bytes"),
    ("too many headers", _post(b"".join(b"X-%d: v\r\n" % i for i in range(10_000))
                               + b"Content-Length: 2\r\n", b"{}{s}"), 431,
     "request line and headers are larger than 65536 bytes"),
]  # fmt: skip


def _refusal_problem(server: Server, raw: bytes, status: int, message: str, marker: Path) -> str:
    """What is wrong with how the server took ``raw``, or "" when it was refused cleanly."""
    smuggled = _smuggled(marker)
    raw = raw.replace(b"{n}", str(len(smuggled)).encode()).replace(b"{s}", smuggled)
    with _connect(server) as sock:
        sock.sendall(raw)
        data, ended = _read_all(sock, 10)
    if ended == "open":
        return "the connection stayed open"
    answers = _answers(data)
    if [s for s, _ in answers] != [status]:
        return f"answered {data[:300]!r}"
    try:
        reply = json.loads(answers[0][1])
    except ValueError:
        return f"answered {data[:300]!r}"
    if reply["code"] != status or message not in reply["message"]:
        return f"answered {reply}"
    time.sleep(0.2)  # a smuggled request would have reached the worker by now
    if marker.exists():
        return "a request smuggled inside it ran"
    reply = server.predict("probe", {"tag": "after"})
    if reply.status != 200:
        return f"the next request got {reply.status} {reply.body!r}"
    return ""


def test_malformed_framing_is_refused_and_nothing_smuggled_runs(
    server: Server, tmp_path: Path
) -> None:
    """Every case of CASES on one server (a server per case would take minutes): each is
    refused with its status and message and the connection closed, the request smuggled in it
    never runs, and a normal request on a fresh connection is served right after."""
    problems = []
    for i, (name, raw, status, message) in enumerate(CASES):
        problem = _refusal_problem(server, raw, status, message, tmp_path / f"smuggled-{i}")
        if problem:
            problems.append(f"{name}: {problem}")
    assert not problems, "\n".join(problems)
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert "Traceback" not in log and "unexpected error" not in log


def test_an_upgrade_without_a_body_is_answered_as_http_1_1_and_closes(
    server: Server, tmp_path: Path
) -> None:
    """RFC 9110 lets a server ignore Upgrade: curl --http2 on http:// gets its answer. Bytes
    after it (llhttp stops parsing there) are never run as a request."""
    marker = tmp_path / "smuggled-ran"
    with _connect(server) as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                     b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n"
                     + _smuggled(marker))  # fmt: skip
        data, ended = _read_all(sock, 10)
    assert ended == "eof"
    [(status, body)] = _answers(data)
    assert status == 200 and json.loads(body) == {"status": "Healthy"}
    assert b"Connection: close\r\n" in data
    time.sleep(0.2)
    assert not marker.exists()
    _still_serving(server)


def test_pipelined_requests_after_a_refused_one_are_never_run(
    server: Server, tmp_path: Path
) -> None:
    """A good request, a malformed one, then a good one on the same connection: the first is
    answered, the second refused, the third never runs."""
    marker = tmp_path / "after-refusal"
    good = _post(b"Content-Length: 2\r\n", b"{}")
    with _connect(server) as sock:
        sock.sendall(good + _post(b"Content-Length: 1\r\nContent-Length: 2\r\n", b"{}")
                     + _smuggled(marker))  # fmt: skip
        data, ended = _read_all(sock, 10)
    assert ended in ("eof", "reset")
    assert [s for s, _ in _answers(data)] == [200, 400]
    time.sleep(0.2)
    assert not marker.exists()
    _still_serving(server)


def test_a_slow_drip_head_is_cut_at_read_timeout(server: Server) -> None:
    """read_timeout_s is 2 here: a head trickled in a byte every 0.3 s is dropped after about
    that long, and the server answers others meanwhile."""
    with _connect(server) as sock:
        started = time.monotonic()
        cut = False
        for byte in b"POST /predictions/probe HTTP/1.1\r\nX-Drip: " + b"d" * 200:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            _, ended = _read_all(sock, 0.3)
            if ended != "open":
                cut = True
                break
            if time.monotonic() - started < 1.0:
                _still_serving(server)  # others are served while the drip goes on
        took = time.monotonic() - started
    assert cut, "a head trickling in was never cut off"
    assert 1.5 < took < 2 + 5 + 1, took  # read_timeout_s, checked every read_timeout_s / 2
    _still_serving(server)


def test_a_connection_flood_over_max_connections(make_archive, start_server) -> None:
    """Past max_connections every new connection is closed at once; those already open keep
    working, and once the flood is gone new clients are served again."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={**OPEN, "max_connections": 8})
    held = []
    try:
        for _ in range(8):
            sock = _connect(server)
            sock.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\n\r\n")
            head = sock.recv(65536)
            assert head.startswith(b"HTTP/1.1 200"), head
            held.append(sock)
        refused = 0
        for _ in range(200):
            with _connect(server) as extra:
                try:
                    extra.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    refused += 1
                    continue
                data, ended = _read_all(extra, 5)
                assert ended in ("eof", "reset") and data == b"", data
                refused += 1
        assert refused == 200
        held[0].sendall(_post(b"Content-Length: 15\r\nConnection: close\r\n",
                              b'{"tag": "kept"}'))  # fmt: skip
        [(status, body)] = _answers(_read_all(held[0], 10)[0])
        assert status == 200 and json.loads(body)["body"] == {"tag": "kept"}
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the server notices the closes
        reply = _try_ping(server)
        if reply == 200:
            break
        time.sleep(0.1)
    assert _try_ping(server) == 200
    _still_serving(server)


def _try_ping(server: Server) -> int | None:
    try:
        return http_call("GET", server.url("inference", "/ping"), timeout=5).status
    except OSError:
        return None
