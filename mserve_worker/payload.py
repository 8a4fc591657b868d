"""Request bodies in, handler outputs out: the ``data[i]`` dict and the response bytes.

This runs inside a worker process, in the model's own Python environment: standard library only,
Python 3.8+, nothing done at import time.

:func:`decode_request` builds the dict a TorchServe handler gets for one request:

- A request that is not a form: ``"body"``. JSON (``application/json`` or any ``+json`` type) is
  parsed; ``text/*`` becomes ``str`` (the ``charset`` parameter, default UTF-8, undecodable bytes
  replaced); everything else is the raw ``bytes``.
- A form request (``multipart/form-data``, ``application/x-www-form-urlencoded``): one key per
  field, as TorchServe's frontend turns each form field into one input of the request; a
  multipart request has no ``"body"`` (unless a field has that name), as in TorchServe. A
  url-encoded one keeps ``"body"``, the bytes as sent, beside its fields: that is the type clients
  give a raw body by default (curl's ``-d``, urllib), and a handler that reads ``body`` (as
  mserve gave it before) keeps working; one that reads the fields, as a TorchServe handler does,
  sees them as TorchServe gives them. Values are typed as TorchServe's worker types them: a file
  part (one with a ``filename``) by its own Content-Type, ``application/octet-stream`` when it
  names none: ``application/json`` parsed, ``text/*`` a UTF-8 ``str``, either left as ``bytes``
  when it does not decode; everything else ``bytes``, and so is every plain field (``-F
  name=value``) and every url-encoded field. When a name repeats, the last value wins.
- Query parameters are added under their own names unless a field (or ``body``) has that name.

:func:`encode_output` turns one element of the handler's returned list into response bytes and a
content type. A malformed request or an output we cannot encode raises :class:`PayloadError`; the
runtime answers that one request (400 for requests) and carries on with the rest of the batch.
"""

from __future__ import annotations

import binascii
import json
from collections.abc import Iterable, Mapping
from typing import Any

from . import fastjson
from .protocol import json_encoder

OCTET_STREAM = "application/octet-stream"
TEXT_PLAIN = "text/plain; charset=utf-8"
JSON = "application/json"


class PayloadError(ValueError):
    """A request body that does not match its content type, or an output we cannot send."""


# Reading requests.


def decode_request(
    content_type: str,
    headers: Iterable[Any] | Mapping[str, Any],
    body: bytes | bytearray | memoryview,
    params: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The ``data[i]`` dict for one request.

    ``content_type`` is the request's Content-Type header as sent (parameters included); when it
    is empty, the one in ``headers`` (``[name, value]`` pairs or a mapping) is used.
    """
    if not content_type:
        content_type = _find_header(headers, "content-type") or ""
    raw = body if isinstance(body, bytes) else bytes(body)
    parsed = _PARSED_TYPES.get(content_type)
    if parsed is None:
        mime, params_of_type = _parse_content_type(content_type)
        parsed = mime, params_of_type, is_json(mime)
        if len(_PARSED_TYPES) >= _PARSED_TYPES_KEPT:  # clients choose them: a bounded memory
            _PARSED_TYPES.clear()
        _PARSED_TYPES[content_type] = parsed
    mime, params_of_type, json_body = parsed

    data: dict[str, Any]
    if json_body:
        data = {"body": _decode_json(raw, params_of_type.get("charset"), content_type)}
    elif mime == "multipart/form-data":
        data = _decode_multipart(raw, content_type, params_of_type)
    elif mime == "application/x-www-form-urlencoded":
        data = _decode_urlencoded(raw, params_of_type.get("charset"), content_type)
        data.setdefault("body", raw)
    elif mime.startswith("text/"):
        data = {"body": _decode_text(raw, params_of_type.get("charset"), content_type)}
    else:
        data = {"body": raw}

    for name, value in (params or {}).items():
        if name not in data:
            data[name] = value
    return data


def with_body(row: Any, context: Any, idx: int) -> Any:
    """``row`` for the handler styles whose contract is one body per request (hooks, kernels,
    mlrun's V2ModelServer): a form request has fields and no ``body`` (as in TorchServe), so
    its ``body`` is the bytes as sent; ``curl -d '{...}'`` sends JSON as a form."""
    if isinstance(row, dict) and "body" not in row:
        return {**row, "body": context.get_request_body(idx)}
    return row


def _find_header(headers: Iterable[Any] | Mapping[str, Any], wanted: str) -> str | None:
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    for name, value in pairs:
        name = name.decode("latin-1") if isinstance(name, (bytes, bytearray)) else str(name)
        if name.lower() == wanted:
            if isinstance(value, (bytes, bytearray)):
                return bytes(value).decode("latin-1")
            return str(value)
    return None


# Content types as requests sent them -> (mime, parameters, whether JSON): a server's clients send
# a handful, and ``application/json; charset=utf-8`` costs the email package's parser each time
# otherwise. The parameters' dicts are shared: read, never changed.
_PARSED_TYPES: dict[str, tuple[str, dict[str, str], bool]] = {}
_PARSED_TYPES_KEPT = 64


def _parse_content_type(content_type: str) -> tuple[str, dict[str, str]]:
    """``("type/subtype", {param: value})``, lower-case type and parameter names."""
    mime = content_type.split(";", 1)[0].strip().lower()
    if ";" not in content_type:
        return mime, {}
    import email.message  # here: most requests never need the email package (memory, start)
    import email.utils

    message = email.message.Message()
    message["content-type"] = content_type
    params = {}
    for name, value in message.get_params(failobj=[])[1:]:  # values come unquoted
        if not isinstance(value, str):  # RFC 2231: (charset, language, text)
            value = email.utils.collapse_rfc2231_value(value)
        params[name.lower()] = value
    return mime, params


def is_json(mime: str) -> bool:
    """Whether a media type (lower-case, no parameters) is JSON, which the worker parses:
    ``application/json`` or ``application/*+json``."""
    return mime == JSON or (mime.startswith("application/") and mime.endswith("+json"))


def _decode_with(raw: bytes, charset: str, errors: str, content_type: str) -> str:
    try:
        return raw.decode(charset, errors=errors)
    except LookupError:
        raise PayloadError(
            f"unknown charset {charset!r} in Content-Type {content_type!r}"
        ) from None


def _decode_text(raw: bytes, charset: str | None, content_type: str) -> str:
    return _decode_with(raw, charset or "utf-8", "replace", content_type)


# json.loads on bytes runs ~25 lines of Python around the C scanner (encoding detection,
# whitespace regexes); a body opening with "{" or "[" is UTF-8 by json's own detection rule
# (no BOM, no zero byte among the first two), so it goes to the scanner directly.
_JSON_SCAN = json.JSONDecoder().scan_once  # what JSONDecoder.raw_decode calls
_JSON_OPENERS = (b"{", b"[")
_JSON_SPACE = " \t\n\r"  # what json skips around a document
_UTF8 = ("utf-8", "utf8")  # a charset parameter that changes nothing for JSON


def _decode_json(raw: bytes, charset: str | None, content_type: str) -> Any:
    if not raw or raw.isspace():  # as ``not raw.strip()``, without copying the body
        raise PayloadError(f"request body is empty but Content-Type is {content_type!r}")
    try:
        if charset:
            if charset.lower() in _UTF8:  # orjson reads only what strict UTF-8 decoding keeps
                value = fastjson.decode(raw)
                if value is not fastjson.NOT_DECODED:
                    return value
            return json.loads(_decode_with(raw, charset, "strict", content_type))
        if raw[:1] in _JSON_OPENERS and raw[1:2] != b"\0":  # UTF-8, as json.loads would detect
            value = fastjson.decode(raw)
            if value is not fastjson.NOT_DECODED:
                return value
            text = raw.decode("utf-8", "surrogatepass")  # raises as json.loads would
            try:
                value, end = _JSON_SCAN(text, 0)
            except StopIteration:  # no JSON value at all: json.loads says where
                return json.loads(raw)
            if end == len(text) or not text[end:].strip(_JSON_SPACE):
                return value
        return json.loads(raw)  # detects UTF-8, UTF-16 and UTF-32; the precise error
    except UnicodeDecodeError as exc:
        raise PayloadError(
            f"request body is not valid {exc.encoding} text "
            f"(Content-Type {content_type!r}): {exc.reason} at byte {exc.start}"
        ) from None
    except json.JSONDecodeError as exc:
        raise PayloadError(
            f"request body is not valid JSON (Content-Type {content_type!r}): {exc}"
        ) from None


def _decode_urlencoded(raw: bytes, charset: str | None, content_type: str) -> dict[str, bytes]:
    """Each field's value as bytes in the form's charset, as TorchServe's frontend passes it."""
    import urllib.parse

    encoding = charset or "utf-8"
    text = _decode_with(raw, encoding, "replace", content_type)
    fields = urllib.parse.parse_qsl(text, keep_blank_values=True, encoding=encoding)
    return {name: value.encode(encoding, errors="replace") for name, value in fields}


# multipart/form-data. The stdlib ``email`` package reads each part's headers (quoting, RFC 2231
# filenames, charsets); the part boundaries are found with bytes.find, since the email feed parser
# goes line by line in Python, far too slowly for large uploads.


def _decode_multipart(
    raw: bytes, content_type: str, params_of_type: dict[str, str]
) -> dict[str, Any]:
    boundary = params_of_type.get("boundary")
    if not boundary:
        raise PayloadError(f"multipart request has no boundary in Content-Type {content_type!r}")
    dash = b"--" + boundary.encode("latin-1", errors="replace")
    delimiter = b"\r\n" + dash
    if raw.startswith(dash):
        pos = len(dash)
    else:
        first = raw.find(delimiter)
        if first < 0:
            raise PayloadError(
                f"multipart body does not contain its boundary {boundary!r} "
                f"(Content-Type {content_type!r})"
            )
        pos = first + len(delimiter)

    fields: dict[str, Any] = {}
    number = 0
    while True:
        if raw.startswith(b"--", pos):
            return fields  # the closing delimiter; anything after it is an epilogue
        line_end = raw.find(b"\r\n", pos)
        if line_end < 0 or raw[pos:line_end].strip(b" \t"):
            raise PayloadError(f"multipart body is malformed after boundary {number}")
        start = line_end + 2
        end = raw.find(delimiter, start)
        if end < 0:
            raise PayloadError(
                f"multipart body ends inside part {number + 1}: no closing boundary "
                f"(the upload may be truncated)"
            )
        number += 1
        name, value = _decode_part(raw, start, end, number)
        fields[name] = value
        pos = end + len(delimiter)


def _decode_part(raw: bytes, start: int, end: int, number: int) -> tuple[str, Any]:
    if raw.startswith(b"\r\n", start):
        header_block, content_start = "", start + 2
    else:
        header_end = raw.find(b"\r\n\r\n", start, end)
        if header_end < 0:
            raise PayloadError(f"multipart part {number} has no blank line after its headers")
        header_block = raw[start:header_end].decode("utf-8", errors="replace")
        content_start = header_end + 4
    import email.parser

    headers = email.parser.HeaderParser().parsestr(header_block + "\r\n\r\n")

    name = headers.get_param("name", header="content-disposition")
    if not isinstance(name, str) or not name:
        raise PayloadError(
            f"multipart part {number} has no name (expected Content-Disposition: form-data; "
            f'name="..."), found {headers.get("content-disposition")!r}'
        )
    content = raw[content_start:end]
    encoding = (headers.get("content-transfer-encoding") or "").strip().lower()
    if encoding == "base64":
        try:
            content = binascii.a2b_base64(content)
        except binascii.Error as exc:
            raise PayloadError(f"multipart field {name!r}: bad base64: {exc}") from None
    elif encoding == "quoted-printable":
        import quopri

        content = quopri.decodestring(content)

    if headers.get_filename() is None:
        return name, content  # a plain field: TorchServe passes its bytes with no content type
    # a file: typed by its Content-Type (without parameters), octet-stream when it has none
    mime = headers.get_content_type() if "content-type" in headers else OCTET_STREAM
    return name, _typed_input(name, content, mime)


def _typed_input(name: str, content: bytes, mime: str) -> Any:
    """An input as TorchServe's worker decodes one by its content type: JSON parsed, ``text*``
    as UTF-8, else (or when that fails) the bytes themselves."""
    if mime == JSON:
        try:
            return json.loads(content.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError and JSONDecodeError
            import logging

            logging.getLogger(__name__).warning(
                "form field %r says application/json but is not JSON: passed on as bytes", name
            )
            return content
    if mime.startswith("text"):
        try:
            return content.decode("utf-8")
        except UnicodeDecodeError:
            return content
    return content


# Writing responses.


def encode_output(value: Any, content_type_override: str = "") -> tuple[bytes, str]:
    """Response bytes and content type for one handler output.

    Bytes-like values go out as they are (``application/octet-stream``), ``str`` as UTF-8
    (``text/plain; charset=utf-8``), anything else as compact JSON (``application/json``).
    ``content_type_override`` (what the handler set through the context) replaces the content
    type, never the encoding.
    """
    if isinstance(value, bytes):
        body, content_type = value, OCTET_STREAM
    elif isinstance(value, (bytearray, memoryview)):
        body, content_type = bytes(value), OCTET_STREAM
    elif isinstance(value, str):
        try:
            body, content_type = value.encode("utf-8"), TEXT_PLAIN
        except UnicodeEncodeError as exc:  # a lone surrogate: UTF-8 has no bytes for it
            raise PayloadError(
                f"handler output is a str holding {exc.object[exc.start]!a} at index "
                f"{exc.start}, a lone surrogate that UTF-8 cannot carry; return bytes, or text "
                f"without it"
            ) from None
    else:
        body, content_type = _encode_json(value), JSON
    return body, content_type_override or content_type


def _type_name(value: Any) -> str:
    kind = type(value)
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def _refuse(value: Any) -> Any:
    hint = " (convert it with .tolist() first)" if hasattr(value, "tolist") else ""
    raise PayloadError(
        f"handler output contains a {_type_name(value)}, which cannot be sent as JSON{hint}; "
        f"return bytes, str, or JSON values (dict, list, str, int, float, bool, None)"
    )


# Built once: json.dumps with options builds a new encoder per call, a fifth of the cost of
# encoding a typical small result; json_encoder skips what JSONEncoder.encode redoes per call.
_OUTPUT_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=_refuse)
_encode_output_json = json_encoder(_OUTPUT_ENCODER)
# The same without the cycle check: one C encoder made once, not one per answer (~6,000 of a
# small answer's ~10,000 instructions). A cycle then ends in RecursionError, and the checked
# encoder above, run only then, says "Circular reference detected" as before.
_encode_output_fast = json_encoder(_OUTPUT_ENCODER, check_circular=False)


def _encode_json(value: Any) -> bytes:
    body = fastjson.encode(value)
    if body is not None:
        return body
    try:
        try:
            text = _encode_output_fast(value)
        except RecursionError:  # a cycle, or nesting past the limit: the checked run says which
            text = _encode_output_json(value)
    except PayloadError:
        raise
    except (TypeError, ValueError) as exc:  # non-str dict keys, circular references
        raise PayloadError(
            f"handler output of type {_type_name(value)} cannot be sent as JSON: {exc}"
        ) from None
    # a lone surrogate in a string (from a body's "\ud800", or undecodable bytes) has no UTF-8:
    # it goes out as the JSON escape it came as, which reads back as the same string
    return text.encode("utf-8", "backslashreplace")
