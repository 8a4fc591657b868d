"""The RELOAD and RELOADED frames: the server asks a worker to re-import its handler's code in
place (hot reload, docs/hot-reload.md) in two steps, and the worker answers each step.

A reload is two-phase so that the workers of a model never end up split between two versions of
the code: ``prepare`` imports the new code and initialises a new handler beside the old one,
which keeps serving; only when every worker has prepared does the server send ``commit`` (switch
to the new handler), else ``abort`` (drop it). Sans-IO and standard library only, Python 3.8, as
the rest of the codec (docs/protocol.md, Hot reload); re-exported by :mod:`.protocol`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .entries import _check_bool, _check_str, _check_uint, _required
from .framing import Frame, Kind, ProtocolError

PREPARE, COMMIT, ABORT = "prepare", "commit", "abort"
RELOAD_STEPS = (PREPARE, COMMIT, ABORT)


@dataclass
class Reloaded:
    """A worker's answer to one step. ``code`` (a step that succeeded): the code it now holds,
    ``{"digest": "sha256:...", "files": [...]}`` (after ``prepare``: the new code; after
    ``abort``: the old). A failed step names the error, and where the user's code raised
    (``file``, ``line``) when it did."""

    reload_id: int
    step: str
    ok: bool
    error: str = ""
    traceback: str = ""
    file: str | None = None
    line: int | None = None
    code: dict[str, Any] | None = None
    load_s: float | None = None
    kept: int | None = None  # entries of the keep store the new code asked for (prepare)


def reload_frame(reload_id: int, step: str) -> Frame:
    """Ask the worker to run one step of reload ``reload_id``."""
    _check_uint(reload_id, "RELOAD reload_id")
    if step not in RELOAD_STEPS:
        raise ProtocolError(f"RELOAD step must be one of {', '.join(RELOAD_STEPS)}, got {step!r}")
    return Frame(Kind.RELOAD, {"reload_id": reload_id, "step": step})


def parse_reload(frame: Frame) -> tuple[int, str]:
    if frame.kind != Kind.RELOAD:
        raise ProtocolError(f"expected a RELOAD frame, got {Kind(frame.kind).name}")
    reload_id = _check_uint(_required(frame.meta, "reload_id", "RELOAD"), "RELOAD reload_id")
    step = _required(frame.meta, "step", "RELOAD")
    if step not in RELOAD_STEPS:
        raise ProtocolError(f"RELOAD step must be one of {', '.join(RELOAD_STEPS)}, got {step!r}")
    return reload_id, step


def reloaded_frame(answer: Reloaded) -> Frame:
    """The worker's answer to a RELOAD step; only the fields that say something are sent."""
    _check_uint(answer.reload_id, "RELOADED reload_id")
    meta: dict[str, Any] = {"reload_id": answer.reload_id, "step": answer.step, "ok": answer.ok}
    if not answer.ok:
        meta["error"] = _check_str(answer.error, "RELOADED error")
        meta["traceback"] = answer.traceback
        if answer.file is not None:
            meta["file"] = answer.file
            meta["line"] = answer.line
    for key in ("code", "load_s", "kept"):
        value = getattr(answer, key)
        if value is not None:
            meta[key] = value
    return Frame(Kind.RELOADED, meta)


def parse_reloaded(frame: Frame) -> Reloaded:
    if frame.kind != Kind.RELOADED:
        raise ProtocolError(f"expected a RELOADED frame, got {Kind(frame.kind).name}")
    meta = frame.meta
    where = "RELOADED"
    reload_id = _check_uint(_required(meta, "reload_id", where), f"{where} reload_id")
    step = _required(meta, "step", where)
    if step not in RELOAD_STEPS:
        raise ProtocolError(f"{where} step must be one of {', '.join(RELOAD_STEPS)}, got {step!r}")
    ok = _check_bool(_required(meta, "ok", where), f"{where} ok")
    answer = Reloaded(reload_id, step, ok)
    if not ok:
        answer.error = _check_str(_required(meta, "error", where), f"{where} error")
        answer.traceback = _check_str(meta.get("traceback", ""), f"{where} traceback")
        if meta.get("file") is not None:
            answer.file = _check_str(meta["file"], f"{where} file")
            line = meta.get("line")
            answer.line = None if line is None else _check_uint(line, f"{where} line")
    code = meta.get("code")
    if code is not None:
        if not isinstance(code, dict) or not isinstance(code.get("digest"), str):
            raise ProtocolError(f"{where} code must be an object with a string digest")
        answer.code = code
    load_s = meta.get("load_s")
    if load_s is not None:
        if isinstance(load_s, bool) or not isinstance(load_s, (int, float)) or load_s < 0:
            raise ProtocolError(f"{where} load_s must be a non-negative number, got {load_s!r}")
        answer.load_s = float(load_s)
    kept = meta.get("kept")
    if kept is not None:
        answer.kept = _check_uint(kept, f"{where} kept")
    return answer
