"""The inference port's HTTP/1.1 handling, byte level, through a real server and raw sockets.

The port runs our own connection protocol over httptools (server/rest/inference.py); these are
the cases a client library hides: pipelining, Expect, chunked bodies, keep-alive rules, limits,
malformed input, header injection by a handler.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.server.conftest import Server, http


def _connect(server: Server) -> socket.socket:
    host, port = server.status["inference"].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _request(path: str, body: bytes = b"", *, method: str = "POST", version: str = "1.1",
             headers: dict[str, str] | None = None) -> bytes:  # fmt: skip
    lines = [f"{method} {path} HTTP/{version}", "Host: test"]
    fields = {"Content-Type": "application/json", "Content-Length": str(len(body)),
              **(headers or {})}  # fmt: skip
    lines += [f"{k}: {v}" for k, v in fields.items() if v is not None]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Responses:
    """Reads HTTP/1.1 responses (Content-Length framed) off one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def next(self, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            assert self._fill(), f"connection closed mid-response: {self.buffer!r}"
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = 0 if head_only else int(headers.get("content-length", "0"))
        while len(self.buffer) < length:
            assert self._fill(), "connection closed mid-body"
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split()[1]), headers, body

    def closed(self) -> bool:
        """Whether the server closed the connection (after anything still buffered)."""
        self.sock.settimeout(10)
        try:
            return not self.sock.recv(1) and not self.buffer
        except ConnectionResetError:
            return True


@pytest.fixture
def probe_server(make_archive, start_server) -> Server:
    make_archive("probe", "probe:handle", "probe")
    return start_server(
        "probe=probe.mar", config={"max_request_size_bytes": 4000, "default_workers_per_model": 2}
    )


def test_pipelined_requests_are_answered_in_order_even_when_they_finish_out_of_order(
    probe_server: Server,
) -> None:
    # two workers: the slow first request finishes after the quick second one
    slow = json.dumps({"cmd": "sleep", "s": 0.6, "tag": "first"}).encode()
    quick = json.dumps({"tag": "second"}).encode()
    with _connect(probe_server) as sock:
        sock.sendall(_request("/predictions/probe", slow) + _request("/predictions/probe", quick)
                     + _request("/ping", method="GET"))  # fmt: skip
        replies = Responses(sock)
        tags = []
        for _ in range(2):
            status, _, body = replies.next()
            assert status == 200, body
            tags.append(json.loads(body)["body"]["tag"])
        assert tags == ["first", "second"]
        status, _, body = replies.next()
        assert (status, json.loads(body)) == (200, {"status": "Healthy"})


def test_expect_continue_chunked_body_and_keep_alive(probe_server: Server) -> None:
    with _connect(probe_server) as sock:
        replies = Responses(sock)
        body = json.dumps({"tag": "expected"}).encode()
        sock.sendall(_request("/predictions/probe", headers={
            "Content-Length": str(len(body)), "Expect": "100-continue"}))  # fmt: skip
        sock.settimeout(10)
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        status, headers, answer = replies.next()
        assert status == 200 and json.loads(answer)["body"] == {"tag": "expected"}
        assert "connection" not in headers and headers["x-request-id"]

        chunks = [b'{"tag": ', b'"chun', b'ked"}']
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
        sock.sendall(_request("/predictions/probe", chunked, headers={
            "Content-Length": None, "Transfer-Encoding": "chunked"}))  # type: ignore[dict-item]  # fmt: skip
        status, _, answer = replies.next()
        assert status == 200 and json.loads(answer)["body"] == {"tag": "chunked"}

        sock.sendall(_request("/predictions/probe", b'{"tag": 3}', headers={"Connection": "close"}))
        status, headers, answer = replies.next()
        assert status == 200 and headers["connection"] == "close"
        assert replies.closed()


def test_http_1_0_closes_unless_asked_to_keep_alive(probe_server: Server) -> None:
    with _connect(probe_server) as sock:
        replies = Responses(sock)
        sock.sendall(_request("/predictions/probe", b"{}", version="1.0",
                              headers={"Connection": "keep-alive"}))  # fmt: skip
        status, headers, _ = replies.next()
        assert status == 200 and headers["connection"] == "keep-alive"
        sock.sendall(_request("/ping", method="GET", version="1.0"))
        status, headers, _ = replies.next()
        assert status == 200 and headers["connection"] == "close"
        assert replies.closed()


@pytest.mark.parametrize(
    ("raw", "status", "message"),
    [
        (b"NONSENSE\r\n\r\n", 400, "malformed HTTP request"),
        (b"POST /predictions/probe HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
         400, "malformed HTTP request"),
        (_request("/predictions/probe", headers={"Content-Length": "5000"}), 413,
         "request body is 5000 bytes, more than max_request_size_bytes=4000"),
        (_request("/ping", method="GET", headers={"X-Big": "x" * 70000}), 431,
         "request line and headers are larger than 65536 bytes"),
    ],
)  # fmt: skip
def test_bad_requests_get_an_error_naming_the_problem_and_the_connection_closes(
    probe_server: Server, raw: bytes, status: int, message: str
) -> None:
    with _connect(probe_server) as sock:
        sock.sendall(raw)
        replies = Responses(sock)
        got, headers, body = replies.next()
        assert got == status, body
        assert headers["connection"] == "close"
        assert message in json.loads(body)["message"]
        assert replies.closed()
    # the server is unharmed
    assert probe_server.predict("probe", {"tag": "after"}).status == 200


def test_a_chunked_body_over_the_limit_is_refused_while_it_arrives(probe_server: Server) -> None:
    with _connect(probe_server) as sock:
        sock.sendall(_request("/predictions/probe", headers={
            "Content-Length": None, "Transfer-Encoding": "chunked"}))  # type: ignore[dict-item]  # fmt: skip
        for _ in range(5):
            sock.sendall(b"3e8\r\n" + b"x" * 1000 + b"\r\n")  # 5,000 bytes in all, no end chunk
        status, _, body = Responses(sock).next()
        assert status == 413
        assert "max_request_size_bytes=4000" in json.loads(body)["message"]


def test_routes_unknown_paths_and_methods(probe_server: Server) -> None:
    with _connect(probe_server) as sock:
        replies = Responses(sock)
        sock.sendall(_request("/predictions/probe", method="GET"))
        status, headers, body = replies.next()
        assert status == 405 and headers["allow"] == "POST, PUT"
        assert json.loads(body)["type"] == "MethodNotAllowedException"
        sock.sendall(_request("/nowhere", method="GET") + _request("/predictions//probe"))
        for _ in range(2):
            status, _, body = replies.next()
            assert status == 404 and json.loads(body)["code"] == 404
        # trailing slashes are accepted, as TorchServe accepts them
        sock.sendall(_request("/predictions/probe/", b'{"tag": "slash"}')
                     + _request("/predictions/probe/1.0//", b'{"tag": "slashes"}')
                     + _request("/ping/", method="GET"))  # fmt: skip
        for tag in ("slash", "slashes"):
            status, _, body = replies.next()
            assert status == 200 and json.loads(body)["body"] == {"tag": tag}
        status, _, body = replies.next()
        assert status == 200 and json.loads(body) == {"status": "Healthy"}
        sock.sendall(_request("/predictions/pr%6Fbe?x=first&x=second", b'{"tag": "escaped"}'))
        status, _, body = replies.next()  # %6F is "o"; of repeated parameters the first counts
        assert status == 200 and json.loads(body)["body"] == {"tag": "escaped"}
        assert json.loads(body)["param_x"] == "first"
        sock.sendall(_request("/ping", method="HEAD"))
        status, headers, _ = replies.next(head_only=True)
        assert status == 200 and int(headers["content-length"]) > 0
        sock.settimeout(0.3)  # a HEAD answer has no body
        with pytest.raises(TimeoutError):
            sock.recv(1)


def test_a_handler_header_that_would_split_the_response_is_refused(probe_server: Server) -> None:
    injected = {"cmd": "set_header", "name": "X-Note", "value": "a\r\nSet-Cookie: evil=1"}
    reply = probe_server.predict("probe", injected)
    assert reply.status == 500
    assert "Set-Cookie" not in reply.headers
    assert "set response header 'X-Note'" in reply.json()["message"]
    fine = probe_server.predict("probe", {"cmd": "set_header", "name": "X-Note", "value": "ok"})
    assert fine.status == 200 and fine.headers["X-Note"] == "ok"


def test_a_handler_header_that_utf8_cannot_carry_is_refused(probe_server: Server) -> None:
    """A lone surrogate (a handler may set one; the worker carries it as a \\u escape) cannot be
    written as UTF-8: the caller gets the usual 500, not a connection left waiting for ever."""
    for name, value in [("X-Note", "\ud800"), ("X-\udfff", "v")]:
        body = {"cmd": "set_header", "name": name, "value": value}
        reply = http("POST", probe_server.url("inference", "/predictions/probe"),
                     json.dumps(body).encode(), {"Content-Type": "application/json"}, timeout=20)  # fmt: skip
        assert reply.status == 500
        assert (
            f"set response header {name!r} to a value that is not a valid HTTP header"
            in reply.json()["message"]
        )
    assert probe_server.predict("probe", {"tag": "still here"}).status == 200


def test_framing_headers_stay_the_servers_own(probe_server: Server) -> None:
    with _connect(probe_server) as sock:
        replies = Responses(sock)
        for name, value in [("Content-Length", "3"), ("Transfer-Encoding", "chunked"),
                            ("Connection", "close")]:  # fmt: skip
            body = json.dumps({"cmd": "set_header", "name": name, "value": value}).encode()
            sock.sendall(_request("/predictions/probe", body))
            status, headers, answer = replies.next()
            assert (status, answer) == (200, b"header set")
            assert headers["content-length"] == str(len(b"header set"))
            assert "transfer-encoding" not in headers and "connection" not in headers
        sock.sendall(_request("/ping", method="GET"))  # the connection is still in step
        assert replies.next()[0] == 200


def test_a_client_that_leaves_with_requests_queued_costs_no_worker_time(
    make_archive, start_server, tmp_path
) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")  # one worker
    marker = tmp_path / "ran"
    with _connect(server) as sock:
        sock.sendall(
            _request("/predictions/probe", json.dumps({"cmd": "sleep", "s": 1}).encode())
            + _request("/predictions/probe", json.dumps({"cmd": "touch", "path": str(marker)})
                       .encode())
        )  # fmt: skip
        time.sleep(0.3)  # both parsed; the second waits behind the first
    time.sleep(1.5)  # the first finishes; the second's caller is gone
    assert not marker.exists()
    assert server.predict("probe", {"tag": "still serving"}).status == 200


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (nothing else is expected on it)."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_idle_and_trickling_connections_are_closed(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server(
        "probe=probe.mar", config={"keepalive_timeout_s": 1, "read_timeout_s": 1.5}
    )
    with _connect(server) as idle:
        idle.sendall(_request("/ping", method="GET"))
        assert Responses(idle).next()[0] == 200
        assert _closed_within(idle, 5), "an idle keep-alive connection stayed open"
    with _connect(server) as trickle:  # a byte every 0.2 s: never idle, never complete
        started = time.monotonic()
        closed = False
        for byte in b"POST /predictions/probe HTTP/1.1\r\nX-Slow: " + b"x" * 100:
            try:
                trickle.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if _closed_within(trickle, 0.2):
                closed = True
                break
        assert closed, "a request head trickling in was never cut off"
        assert time.monotonic() - started < 6
    assert server.predict("probe", {"tag": "after"}).status == 200


def test_connections_over_the_limit_are_closed_at_once(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={"max_connections": 3})
    held = [_connect(server) for _ in range(3)]
    try:
        for sock in held:  # each is served (and so counted) before the next opens
            sock.sendall(_request("/ping", method="GET"))
            assert Responses(sock).next()[0] == 200
        with _connect(server) as extra:
            assert _closed_within(extra, 5)
        held[0].sendall(_request("/predictions/probe", b'{"tag": "kept"}'))
        status, _, body = Responses(held[0]).next()
        assert status == 200 and json.loads(body)["body"] == {"tag": "kept"}
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)  # the server sees them close
    with _connect(server) as later:  # room again once they are gone
        later.sendall(_request("/ping", method="GET"))
        assert Responses(later).next()[0] == 200
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert "closed at once: 3 open, the most one port keeps (max_connections)" in log
