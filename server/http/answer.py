"""Answers as bytes: the ``(status, headers, body)`` a router's task returns, TorchServe's JSON
error body, the checks a header passes before it is written, and the ``Date`` every answer
carries.
"""

from __future__ import annotations

import json
import re
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

from server.errors import MserveError

LARGE_BODY = 64 * 1024  # bodies from here on are written next to the head, not copied into it

REASONS = {s.value: s.phrase for s in HTTPStatus}
JSON = "application/json"
# (status, headers, body): what a router's task returns to be answered
Answer = tuple[int, list[list[str]], bytes]


def json_answer(status: int, payload: Any) -> Answer:
    return status, [["Content-Type", JSON]], json.dumps(payload).encode()


# OpenAI's error ``type`` by status (what its clients and SDKs read); 5xx: server_error
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(parts: list[str], error: MserveError, message: str) -> dict[str, object]:
    """TorchServe's ``{code, type, message}``; on KServe's paths (``/v1/...``, ``/v2/...``) the
    Open Inference Protocol's ``{"error": message}``, which its clients read; on ``/openai/...``
    OpenAI's ``{"error": {message, type, param, code}}`` (``param`` and ``code`` from
    server/openai/request.py's OpenAIError). ``message``: the error's, as it may be told to
    this client (server/redaction.py)."""
    if parts and parts[0] in ("v1", "v2"):
        return {"error": message}
    if parts and parts[0] == "openai":
        kind = OPENAI_TYPES.get(error.status, "server_error")
        param, code = getattr(error, "param", None), getattr(error, "code", None)
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return {**error.body(), "message": message}


# RFC 9110 5.6.2: a field name is a token, 1*tchar
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FORBIDDEN_IN_VALUE = re.compile(r"[\r\n\x00]")


def header_problem(name: str, value: str) -> str | None:
    """Why a header cannot be written as it is (None: it can). The name must be an RFC 9110
    token, as Netty's validating headers (TorchServe's frontend) demand; the value must hold no
    CR, LF or NUL (RFC 9110 5.5: a recipient must reject those), and be text the answer's
    encoding (UTF-8, surrogateescape for the bytes a client sent) can carry: a lone surrogate
    from a handler cannot be, and failing to encode it would leave the caller without answer."""
    if not _TOKEN.fullmatch(name):
        return (
            "its name is not an HTTP token (RFC 9110: one or more letters, digits and"
            " !#$%&'*+-.^_`|~; no space, colon, control or non-ASCII character)"
        )
    if _FORBIDDEN_IN_VALUE.search(value):
        return "its value holds a CR, LF or NUL, which HTTP forbids (RFC 9110)"
    if not value.isascii():
        try:
            value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            return "its value holds a lone surrogate, which UTF-8 cannot carry"
    return None


_date_second = -1
_date = ""


def http_date() -> str:
    """RFC 9110 ``Date``, formatted once a second rather than once a response."""
    global _date_second, _date
    now = int(time.time())
    if now != _date_second:
        _date_second, _date = now, formatdate(now, usegmt=True)
    return _date
