"""The PARK and PARKED frames: the server parks an evicted model's idle worker instead of
stopping it, and wakes it again (the warm tier's parked workers, docs/warm-tier.md).

``park``: the worker lets go of its mapped weights' pages (they stay in the page cache, where the
server's warm tier keeps them) and answers what it dropped; it keeps its process, its imports
and its built handler. ``wake``: it maps the pages again and is ready for batches. A worker
offers this in READY (``parks``) only where it can: it serves one batch at a time and its
weights are mapped files. Sans-IO and standard library only, Python 3.8, as the rest of the
codec (docs/protocol.md, Parked workers); re-exported by :mod:`.protocol`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .entries import _check_bool, _check_str, _check_uint, _required
from .framing import Frame, Kind, ProtocolError

PARK, WAKE = "park", "wake"
PARK_STEPS = (PARK, WAKE)


@dataclass
class Parked:
    """A worker's answer to one step. ``bytes``: the mapped weights' bytes it let go of (park)
    or mapped again (wake); ``seconds``: what the step took in the worker; a failed step
    names why (the worker then serves on as it was: the server stops it)."""

    park_id: int
    step: str
    ok: bool
    error: str = ""
    bytes: int = 0
    seconds: float = 0.0


def _check_step(step: object, where: str) -> str:
    if step not in PARK_STEPS:
        raise ProtocolError(f"{where} step must be one of {', '.join(PARK_STEPS)}, got {step!r}")
    return step  # type: ignore[return-value]


def park_frame(park_id: int, step: str) -> Frame:
    """Ask the worker to park (``park``) or to wake (``wake``)."""
    _check_uint(park_id, "PARK park_id")
    return Frame(Kind.PARK, {"park_id": park_id, "step": _check_step(step, "PARK")})


def parse_park(frame: Frame) -> tuple[int, str]:
    if frame.kind != Kind.PARK:
        raise ProtocolError(f"expected a PARK frame, got {Kind(frame.kind).name}")
    park_id = _check_uint(_required(frame.meta, "park_id", "PARK"), "PARK park_id")
    return park_id, _check_step(_required(frame.meta, "step", "PARK"), "PARK")


def parked_frame(answer: Parked) -> Frame:
    _check_uint(answer.park_id, "PARKED park_id")
    meta = {"park_id": answer.park_id, "step": answer.step, "ok": answer.ok,
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
    step = _check_step(_required(meta, "step", where), where)
    ok = _check_bool(_required(meta, "ok", where), f"{where} ok")
    answer = Parked(park_id, step, ok)
    answer.bytes = _check_uint(meta.get("bytes", 0), f"{where} bytes")
    seconds = meta.get("seconds", 0.0)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise ProtocolError(f"{where} seconds must be a non-negative number, got {seconds!r}")
    answer.seconds = float(seconds)
    if not ok:
        answer.error = _check_str(_required(meta, "error", where), f"{where} error")
    return answer
