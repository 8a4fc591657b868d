"""Response headers a handler sets: only valid HTTP fields reach the wire (RFC 9110: a name is a
token; a value holds no CR, LF or NUL). Any other refuses that answer with a 500 that names the
header, the model and the rule, as TorchServe's frontend (Netty's validating headers) refuses
them; the worker and the server carry on."""

from __future__ import annotations

import json
import socket

import pytest

from server.http import header_problem
from tests.server.conftest import Server

NOT_A_TOKEN = (
    "its name is not an HTTP token (RFC 9110: one or more letters, digits and !#$%&'*+-.^_`|~;"
    " no space, colon, control or non-ASCII character)"
)
BAD_VALUE = "its value holds a CR, LF or NUL, which HTTP forbids (RFC 9110)"


@pytest.mark.parametrize(
    "name",
    ["X-Probe", "content-type", "x", "0", "!#$%&'*+-.^_`|~09AZaz"],
)
def test_tokens_are_header_names(name: str) -> None:
    assert header_problem(name, "value") is None


@pytest.mark.parametrize(
    "name",
    ["", "X\x00", "X Note", " X", "X:Note", "Xé", "X\udfff", "X\r", "X\n", "X\t", "X\x7f",
     "(x)", "a,b", 'a"b', "a/b", "a@b", "a=b", "a;b", "{a}", "[a]", "a?", "a\\b"],
)  # fmt: skip
def test_names_that_are_not_tokens_are_refused(name: str) -> None:
    assert header_problem(name, "value") == NOT_A_TOKEN


@pytest.mark.parametrize("value", ["", "v", "a b", "a\tb", "é ünï €", '"(x)"; a=b, c:d'])
def test_values_without_cr_lf_nul(value: str) -> None:
    assert header_problem("X-Note", value) is None


@pytest.mark.parametrize("value", ["a\rb", "a\nb", "a\r\nSet-Cookie: x=1", "a\x00b", "\x00"])
def test_values_with_cr_lf_or_nul_are_refused(value: str) -> None:
    assert header_problem("X-Note", value) == BAD_VALUE


def test_a_value_utf8_cannot_carry_is_refused() -> None:
    assert header_problem("X-Note", "a\ud800") == (
        "its value holds a lone surrogate, which UTF-8 cannot carry"
    )


def _raw_answer(server: Server, model: str, body: dict[str, object]) -> bytes:
    """The answer's bytes as they came off the socket (the connection closes after it)."""
    host, port = server.status["inference"].rsplit(":", 1)
    data = json.dumps(body).encode()
    head = (
        f"POST /predictions/{model} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def _refused(answer: bytes, name: str) -> str:
    """The 500's message; fails if the header went out anyway."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500 "), head
    wire = name.encode("utf-8", "surrogateescape")
    assert wire not in head, head
    return str(json.loads(body)["message"])


def test_a_header_name_http_cannot_carry_never_reaches_the_wire(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    make_archive("streaming", "ts_stream:handle", "ts")
    server = start_server("probe=probe.mar", "ts=ts.mar")
    worker = server.predict("probe", {"tag": "before"}).json()["pid"]
    for name in ["X-\x00Note", "X Note", "X:Note", "X-Noté"]:
        answer = _raw_answer(server, "probe", {"cmd": "set_header", "name": name, "value": "v"})
        assert _refused(answer, name) == (
            f"the handler of probe:1.0 set response header {name!r} to a value that is not a"
            f" valid HTTP header: {NOT_A_TOKEN}"
        )
    answer = _raw_answer(server, "probe", {"cmd": "set_header", "name": "X-Nul", "value": "a\0b"})
    assert _refused(answer, "X-Nul").endswith(f"'X-Nul' to a value that is not a valid HTTP"
                                              f" header: {BAD_VALUE}")  # fmt: skip
    # a streamed answer's headers are checked before its first chunk goes out
    answer = _raw_answer(server, "ts", {"name": "h", "parts": 2, "header": "a\0b"})
    assert "the handler of ts:1.0 set response header 'X-Stream'" in _refused(answer, "X-Stream")
    # the same worker answers on, and a valid header goes out as set
    reply = server.predict("probe", {"cmd": "set_header", "name": "X-Fine_1", "value": "ok"})
    assert reply.status == 200 and reply.headers["X-Fine_1"] == "ok"
    assert server.predict("probe", {"tag": "after"}).json()["pid"] == worker
