"""JSON of request bodies and handlers' answers, through orjson where the model's environment has
it and the result is certain to be the standard library's, else through ``json``.

Why: for a small model, decoding the request's numbers is a large share of serving it. The
example MLP's 256-float body takes ~50-80 us in ``json.loads`` (each number goes through
``float()`` of its text) against ~5-7 us in orjson, next to a ~150 us forward. orjson is a
dependency of the server, so workers in default environments (which see the server's packages)
have it; an isolated environment or another interpreter without it decodes as before.

The two agree on every document both accept (the same floats, bit for bit: correctly rounded;
duplicate keys, the last wins) except integers outside [-2**63, 2**64): orjson makes them floats,
``json.loads`` keeps them exact. A body that may hold one (an integer part of 19 digits or more,
or digits as long inside a string) is left to ``json.loads``, as is every body orjson refuses
(``NaN`` and ``Infinity``, numbers past the float range, lone surrogates, invalid UTF-8, nesting
past 1,024, bad JSON): there ``json.loads`` gives what it always gave, the value or its error.

Answers (:func:`encode`) are the bytes the worker's ``json`` encoder writes (compact, UTF-8 as
is, ``NaN`` as ``NaN``): orjson writes the same for every value both take except ``NaN`` and the
infinities (``null``) and numbers under 1e-4 (``0.00008`` and ``8.9e-7`` against ``8e-05`` and
``8.9e-07``; numbers from 1e-4 up are the same text, tested on millions). So an answer whose
orjson text holds ``null``, ``e-`` or ``0.0000`` (in a number, or merely inside a string: the
check is cautious) is left to ``json``, as is every value orjson refuses: other
types (numpy, datetime, dataclasses, subclasses of str, int, dict and list, which ``json``
either encodes its own way or refuses in words), keys that are not strings, integers past 64
bits, lone surrogates, cycles and nesting past 254. The one difference left: an ``enum.Enum``
member or a ``uuid.UUID`` that is not an int subclass, which ``json`` refuses, goes out as its
value or text.

A model's environment may pin any orjson: at import, one that does not read or write a set of
numbers as ``json`` does (before 3.11.9 it wrote ``1e16`` for ``1e+16``) is not used for that.

Runs inside the model's own environment: standard library only (orjson when present), Python 3.8.
"""

from __future__ import annotations

import json
from typing import Any

try:
    from orjson import OPT_PASSTHROUGH_DATACLASS, OPT_PASSTHROUGH_DATETIME, OPT_PASSTHROUGH_SUBCLASS
    from orjson import JSONDecodeError as _Refused
    from orjson import JSONEncodeError as _Unwritable
    from orjson import dumps as _orjson_dumps
    from orjson import loads as _orjson_loads
except ImportError:  # the standard library's json does it all
    _orjson_loads = _orjson_dumps = None

    class _Refused(Exception):  # type: ignore[no-redef]  # never raised
        pass

    _Unwritable = _Refused
else:
    # what json writes its own way (a str subclass's own text, a datetime refused) is not orjson's
    _ONLY_PLAIN = OPT_PASSTHROUGH_DATACLASS | OPT_PASSTHROUGH_DATETIME | OPT_PASSTHROUGH_SUBCLASS


# Numbers as json writes them (orjson before 3.11.9 wrote 1e16 for 1e+16), and as json reads them
_WRITTEN = (
    b"[1e+16,1e+22,1.5e+300,1.2345678901234568e+20,123456789.0,0.1,-0.0,1000000000000000.0,"
    b"9007199254740992.0,0.0001,2.5,1.7976931348623157e+308,100.0,0.3333333333333333]"
)
_READ = b"[2.2250738585072011e-308, 4.9e-324, 9007199254740993, 1e-7, 0.1, 123.456e-2]"


def _agrees() -> tuple[bool, bool]:
    """Whether this orjson reads, and writes, numbers as json does: a model's environment may
    pin any version, and each of its halves is used only where it does."""
    if _orjson_loads is None:
        return False, False
    try:
        reads = _orjson_loads(_READ) == json.loads(_READ)
        writes = _orjson_dumps(json.loads(_WRITTEN)) == _WRITTEN
    except Exception:  # any surprise: json does the work
        return False, False
    return reads, writes


_READS, _WRITES = _agrees()
if not _READS:
    _orjson_loads = None
if not _WRITES:
    _orjson_dumps = None
AVAILABLE = _orjson_loads is not None  # requests' bodies are read with orjson
NOT_DECODED: Any = object()  # ``decode``'s answer where ``json.loads`` must decide

# Digits become "1", what continues a number's fraction or exponent ".", anything else "0": a
# "0" and 19 "1"s is a run of 19 digits that does not follow a decimal point or an exponent's
# letter, the integer part of a number (or digits in a string) that may overflow 64 bits.
_SHAPES = bytes(0x31 if 0x30 <= b <= 0x39 else 0x2E if b in b".eE" else 0x30 for b in range(256))
_LONG_INTEGER = b"0" + b"1" * 19
_OPENERS = (b"{", b"[")


def decode(body: bytes | bytearray | memoryview) -> Any:
    """``body``'s JSON value when orjson gives exactly what ``json.loads`` would; otherwise
    :data:`NOT_DECODED`, and the caller decodes it as before (value or error). Only bodies that
    open with ``{`` or ``[`` are tried (a UTF-16 or UTF-32 one has zero bytes, which orjson
    refuses)."""
    if _orjson_loads is None or body[:1] not in _OPENERS:
        return NOT_DECODED
    shapes = (bytes(body) if type(body) is memoryview else body).translate(_SHAPES)
    if shapes.find(_LONG_INTEGER) >= 0:
        return NOT_DECODED
    try:
        return _orjson_loads(body)
    except _Refused:
        return NOT_DECODED


def loads(body: bytes | bytearray | memoryview) -> Any:
    """``json.loads(bytes(body))``: its value or its error, by orjson where :func:`decode` can."""
    value = decode(body)
    return json.loads(bytes(body)) if value is NOT_DECODED else value


def encode(value: Any) -> bytes | None:
    """The worker's JSON answer for ``value`` (UTF-8 bytes) when orjson writes exactly what
    ``json`` would; else None, and the caller encodes it with ``json`` (or refuses it) as before.
    In orjson's text, what json may write otherwise: ``null`` (NaN or an infinity), ``0.0000``
    (a number under 1e-4, which json writes with an exponent: 8e-05) and ``e-`` (an exponent:
    json's e-07)."""
    if _orjson_dumps is None:
        return None
    try:
        text = _orjson_dumps(value, option=_ONLY_PLAIN)
    except _Unwritable:
        return None
    find = text.find  # not ``in``: bytes.__contains__ tries the needle as an int first (~0.1 us)
    if find(b"null") >= 0 or find(b"e-") >= 0 or find(b"0.0000") >= 0:
        return None
    return text
