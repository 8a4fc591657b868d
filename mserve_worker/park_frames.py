"""The PARK and PARKED frames: the server parks an evicted model's idle worker instead of
stopping it (the warm tier's parked workers, docs/warm-tier.md).

``PARK``: the worker is idle for a while: it trims its heap and keeps its process, its imports,
its built handler and its mapped weights (their pages are the page cache's, which the server's
warm tier keeps); it answers ``PARKED``. Waking it needs no frame: its next ``BATCH`` is served
by the handler it already built. A worker offers this in READY (``parks``) only where it can:
it serves one batch at a time and its weights are mapped files (park.py). Sans-IO and standard
library only, Python 3.8, as the rest of the codec (docs/protocol.md, Parked workers);
re-exported by :mod:`.protocol`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .entries import _check_bool, _check_str, _check_uint, _required
from .framing import Frame, Kind, ProtocolError


@dataclass
class Parked:
    """A worker's answer. ``bytes``: the size of the mapped weights it keeps; ``seconds``: what
    parking took in the worker; a failed park names why (the server then stops the worker)."""

    park_id: int
    ok: bool
    error: str = ""
    bytes: int = 0
    seconds: float = 0.0


def park_frame(park_id: int) -> Frame:
    _check_uint(park_id, "PARK park_id")
    return Frame(Kind.PARK, {"park_id": park_id})


def parse_park(frame: Frame) -> int:
    if frame.kind != Kind.PARK:
        raise ProtocolError(f"expected a PARK frame, got {Kind(frame.kind).name}")
    return _check_uint(_required(frame.meta, "park_id", "PARK"), "PARK park_id")


def parked_frame(answer: Parked) -> Frame:
    _check_uint(answer.park_id, "PARKED park_id")
    meta = {"park_id": answer.park_id, "ok": answer.ok,
            "bytes": _check_uint(answer.bytes, "PARKED bytes"),
            "seconds": round(float(answer.seconds), 6)}  # fmt: skip
    if not answer.ok:
        meta["error"] = _check_str(answer.error, "PARKED error")
    return Frame(Kind.PARKED, meta)


def parse_parked(frame: Frame) -> Parked:
    if frame.kind != Kind.PARKED:
        raise ProtocolError(f"expected a PARKED frame, got {Kind(frame.kind).name}")
    meta, where = frame.meta, "PARKED"
    park_id = _check_uint(_required(meta, "park_id", where), f"{where} park_id")
    ok = _check_bool(_required(meta, "ok", where), f"{where} ok")
    answer = Parked(park_id, ok)
    answer.bytes = _check_uint(meta.get("bytes", 0), f"{where} bytes")
    seconds = meta.get("seconds", 0.0)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise ProtocolError(f"{where} seconds must be a non-negative number, got {seconds!r}")
    answer.seconds = float(seconds)
    if not ok:
        answer.error = _check_str(_required(meta, "error", where), f"{where} error")
    return answer
