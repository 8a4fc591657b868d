"""Abuse of the HTTP layer through a real server and raw sockets: oversized bodies that the
client is still sending.
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

from tests.server.conftest import Server

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


def test_a_client_sending_far_beyond_the_drain_cap_is_cut_off(server: Server) -> None:
    """The refused body is dropped as it comes, up to 8 MiB: a client sending on and on is cut
    off there, and the server holds none of it."""
    before = _rss_bytes(server.pid)
    with _connect(server) as sock:
        sock.sendall(b"POST /predictions/probe HTTP/1.1\r\nHost: t\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        chunk = b"10000\r\n" + b"z" * 65536 + b"\r\n"
        sent, cut = 0, False
        started = time.monotonic()
        while sent < 256 * MIB and time.monotonic() - started < 30:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            sent += len(chunk)
        assert cut, f"sent {sent} bytes and the server still read them"
        assert sent < 32 * MIB, sent  # the cap (8 MiB) plus what socket buffers hold
    assert _rss_bytes(server.pid) - before < 16 * MIB
    _still_serving(server)


def test_a_declared_body_over_the_drain_cap_is_not_waited_for(server: Server) -> None:
    with _connect(server) as sock:
        sock.sendall(b"POST /predictions/probe HTTP/1.1\r\nHost: t\r\n"
                     b"Content-Length: 1073741824\r\n\r\n")  # fmt: skip
        started = time.monotonic()
        data, ended = _read_all(sock, 5)
        assert ended in ("eof", "reset") and time.monotonic() - started < 2
        [(status, body)] = _answers(data)
        assert status == 413 and b"1073741824 bytes" in body
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
