"""Request bodies' JSON, decoded by orjson where the model's environment has it and its answer is
certain to be ``json.loads``'s, else by ``json.loads``.

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

Runs inside the model's own environment: standard library only (orjson when present), Python 3.8.
"""

from __future__ import annotations

import json
from typing import Any

try:
    from orjson import JSONDecodeError as _Refused
    from orjson import loads as _orjson_loads
except ImportError:  # the standard library's json decodes every body
    _orjson_loads = None

    class _Refused(Exception):  # type: ignore[no-redef]  # never raised
        pass


AVAILABLE = _orjson_loads is not None
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
    if _LONG_INTEGER in (bytes(body) if type(body) is memoryview else body).translate(_SHAPES):
        return NOT_DECODED
    try:
        return _orjson_loads(body)
    except _Refused:
        return NOT_DECODED


def loads(body: bytes | bytearray | memoryview) -> Any:
    """``json.loads(bytes(body))``: its value or its error, by orjson where :func:`decode` can."""
    value = decode(body)
    return json.loads(bytes(body)) if value is NOT_DECODED else value
