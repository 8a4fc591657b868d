"""What a capture recorded: mserve's inference-log files (JSON lines, rotated, gzipped) and
folders of KServe's CloudEvents in the CloudEvents JSON format, read into :class:`Recorded`
pairs of a request and its answer.

Nothing here raises for bad input: a line that is not a record, a record without its request
body, a record of another model or outside the window is counted in :class:`Skipped` (with the
first few places and reasons, for the report) and the reading goes on.
"""

from __future__ import annotations

import base64
import gzip
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

# KServe's event types (pkg/logger), as server/inference_log/records.py sends them
REQUEST_EVENT = "org.kubeflow.serving.inference.request"
RESPONSE_EVENT = "org.kubeflow.serving.inference.response"
# How many bad places the report quotes: the counts say how many there were in all
_KEEP_PLACES = 20
# A line above this is not read (a corrupt file without line breaks must not fill memory)
_MAX_LINE_BYTES = 64 * 1024 * 1024
_ROTATED = re.compile(r"\.(\d+)(\.gz)?$")


@dataclass
class Recorded:
    """One recorded request and its answer. ``response`` is None when the capture holds no
    answer for it (a CloudEvents request whose answer was not a 200: KServe sends none)."""

    id: str
    model: str
    version: str
    api: str  # "torchserve", "v1", "v2" or "" (not recorded: a CloudEvent)
    op: str
    when: float  # arrival, seconds since the epoch (0 when not recorded)
    microsec: int  # arrival to answer, as the server measured it (0 when not recorded)
    request: bytes
    request_type: str
    status: int
    response: bytes | None
    response_type: str
    where: str  # file:line, for the report


@dataclass
class Skipped:
    """Records not replayed, by reason, and the first few places of each."""

    counts: Counter[str] = field(default_factory=Counter)
    places: list[dict[str, str]] = field(default_factory=list)

    def add(self, reason: str, where: str, detail: str = "") -> None:
        self.counts[reason] += 1
        if len(self.places) < _KEEP_PLACES:
            self.places.append({"reason": reason, "where": where, "detail": detail[:200]})


def log_files(paths: list[Path]) -> list[Path]:
    """The files to read, oldest first: a folder gives its ``*.jsonl*`` files, and a file its
    rotated siblings are not added (name each, or the folder). Rotated files (``x.jsonl.3``
    is older than ``x.jsonl.1``, which is older than ``x.jsonl``) sort before the live one."""
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = [p for p in path.rglob("*") if p.is_file()]
            out.extend(sorted(found, key=_age_key))
        else:
            out.append(path)
    return out


def _age_key(path: Path) -> tuple[str, int]:
    match = _ROTATED.search(path.name)
    base = path.name[: match.start()] if match else path.name.removesuffix(".gz")
    number = int(match.group(1)) if match else 0
    return (str(path.parent / base), -number)


def _open_lines(path: Path) -> Iterator[bytes]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:  # type: ignore[operator]
        while True:
            line = f.readline(_MAX_LINE_BYTES)
            if not line:
                return
            yield line


def read(paths: list[Path], skipped: Skipped) -> Iterator[Recorded]:
    """Every record of ``paths`` (files or folders), in file order; CloudEvents are paired by
    id first, so they come once every file was read."""
    events: dict[str, dict[str, Any]] = {}
    for path in log_files(paths):
        if path.name.endswith(".json"):
            _read_event_file(path, events, skipped)
            continue
        try:
            for number, line in enumerate(_open_lines(path), 1):
                where = f"{path}:{number}"
                text = line.strip()
                if not text:
                    continue
                decoded = text.decode("utf-8", "replace")
                split = _split_line(decoded)
                if split is not None:
                    doc, raw = split
                else:
                    try:
                        doc, raw = json.loads(text), {}
                    except (ValueError, RecursionError) as exc:
                        skipped.add("not_a_record", where, f"not JSON: {exc}")
                        continue
                if isinstance(doc, dict) and "specversion" in doc:
                    _keep_event(doc, where, events, skipped)
                    continue
                record = _from_line(doc, raw, where, skipped)
                if record is not None:
                    yield record
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            skipped.add("unreadable_file", str(path), str(exc))
    yield from _pair(events, skipped)


# --- inference-log lines -------------------------------------------------------------------

_NEEDED = ("model", "version", "status")


def _from_line(doc: Any, raw: dict[str, str], where: str, skipped: Skipped) -> Recorded | None:
    if not isinstance(doc, dict) or not all(k in doc for k in _NEEDED):
        missing = [k for k in _NEEDED if not isinstance(doc, dict) or k not in doc]
        skipped.add("not_a_record", where, f"a JSON value without {', '.join(missing)}")
        return None
    if doc.get("api") == "event":
        skipped.add("event", where, f"{doc.get('op')}: {doc.get('error')}")
        return None
    if "request" not in doc:
        skipped.add("no_request_body", where, "recorded with inferenceLog: response")
        return None
    status = doc["status"]
    if isinstance(status, bool) or not isinstance(status, int):
        skipped.add("not_a_record", where, f"status {status!r} is not a number")
        return None
    request, request_type = _body(doc["request"], raw.get("request"))
    response = response_type = None
    if "resp" in doc:
        response, response_type = _body(doc["resp"], raw.get("resp"))
    elif status >= 400:  # an error is recorded without a body: its status is what counts
        response, response_type = b"", ""
    return Recorded(
        id=str(doc.get("id", doc.get("request_id", ""))),
        model=str(doc["model"]),
        version=str(doc["version"]),
        api=str(doc.get("api") or "torchserve"),
        op=str(doc.get("op") or "predict"),
        when=_seconds(doc.get("when")),
        microsec=int(doc.get("microsec") or 0),
        request=request,
        request_type=request_type,
        status=status,
        response=response,
        response_type=response_type or "",
        where=where,
    )


def _split_line(line: str) -> tuple[dict[str, Any], dict[str, str]] | None:
    """A line's fields and the ``request`` and ``resp`` values as the logger wrote them, or
    None when the line is not in the logger's form (the caller parses it whole). A JSON body
    goes into the line as the client sent it (server/inference_log/records.py's value_text),
    so its text is the body's bytes, not a re-encoding. The fields before the bodies are
    scalars, in whose JSON strings a quote is escaped, so the first ``,"request":`` is the
    field itself. The line is parsed once: the scalars, then each body where it starts (a
    body parsed for its fields and again for its text cost twice the CPU of the replay's
    sending, for a 64-float body)."""
    fast = _split_plain(line)
    if fast is not None:
        return fast
    starts = [(line.find(f',"{key}":'), key) for key in ("request", "resp")]
    found = sorted((at, key) for at, key in starts if at > 0)
    if not found:
        return None
    decoder = json.JSONDecoder()
    try:
        doc = json.loads(line[: found[0][0]] + "}")
        raw: dict[str, str] = {}
        at = found[0][0]
        for key in ("request", "resp"):
            marker = f',"{key}":'
            if not line.startswith(marker, at):
                continue
            begin = at + len(marker)
            value, at = decoder.raw_decode(line, begin)
            doc[key] = value
            raw[key] = line[begin:at]
        rest = line[at:]
        if rest != "}":
            if not rest.startswith(","):
                return None
            doc.update(json.loads("{" + rest[1:]))
    except (ValueError, RecursionError, TypeError, AttributeError):
        return None
    return (doc, raw) if isinstance(doc, dict) else None


class _Raw(str):
    """A JSON body's text as logged, not parsed (the replay sends it and compares bytes)."""


# the fields a v2 model class's line may have after its bodies (records.py's Encoder.line)
_AFTER_BODIES = (',"class":', ',"worker":', ',"metrics":', ',"error":', ',"op":')


def _split_plain(line: str) -> tuple[dict[str, Any], dict[str, str]] | None:
    """The common line, in which parsing the bodies is most of the replay's CPU: both bodies,
    each marker once (so the top-level one), the answer last. A JSON body is only cut out; a
    string or ``{"base64"...}`` is parsed. None for any other line (the caller parses it)."""
    request_at = line.find(',"request":')
    resp_at = line.find(',"resp":')
    if (
        request_at < 0
        or resp_at < request_at
        or not line.endswith("}")
        or line.count(',"request":') != 1
        or line.count(',"resp":') != 1
        or any(marker in line[resp_at:] for marker in _AFTER_BODIES)
    ):
        return None
    try:
        doc = json.loads(line[:request_at] + "}")
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    raw = {"request": line[request_at + 11 : resp_at], "resp": line[resp_at + 8 : -1]}
    for key, text in raw.items():
        if text[:1] == '"' or text.startswith('{"base64":') or text in ("null", ""):
            try:
                doc[key] = json.loads(text)
            except (ValueError, RecursionError):
                return None
        else:
            doc[key] = _Raw(text)
    return doc, raw


def _body(value: Any, raw: str | None) -> tuple[bytes, str]:
    """A logged body back as bytes and a content type: parsed JSON as it was sent, text as
    text, ``{"base64": ...}`` as the bytes it stands for."""
    if isinstance(value, _Raw):
        return value.encode(), "application/json"
    if value is None:
        return b"", ""
    if isinstance(value, str):
        return value.encode(), "text/plain"
    if isinstance(value, dict) and set(value) == {"base64"} and isinstance(value["base64"], str):
        try:
            return base64.b64decode(value["base64"], validate=True), "application/octet-stream"
        except ValueError:
            pass
    if raw is not None:
        return raw.encode(), "application/json"
    return json.dumps(value, separators=(",", ":")).encode(), "application/json"


def _seconds(when: Any) -> float:
    if not isinstance(when, str):
        return 0.0
    try:
        return datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


# --- CloudEvents ---------------------------------------------------------------------------


def _keep_event(
    doc: dict[str, Any], where: str, events: dict[str, dict[str, Any]], skipped: Skipped
) -> None:
    kind = doc.get("type")
    if kind not in (REQUEST_EVENT, RESPONSE_EVENT) or not isinstance(doc.get("id"), str):
        skipped.add("not_a_record", where, f"a CloudEvent of type {kind!r}, not KServe's logger's")
        return
    pair = events.setdefault(doc["id"], {})
    pair[kind] = (doc, where)


def _read_event_file(path: Path, events: dict[str, dict[str, Any]], skipped: Skipped) -> None:
    """A ``.json`` file: one event in the CloudEvents JSON format, or a batch (a list)."""
    try:
        if path.stat().st_size > _MAX_LINE_BYTES:
            skipped.add("not_a_record", str(path), "a .json file over 64 MiB")
            return
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        skipped.add("not_a_record", str(path), f"not a CloudEvent in JSON: {exc}")
        return
    for i, event in enumerate(doc if isinstance(doc, list) else [doc]):
        where = f"{path}:{i + 1}" if isinstance(doc, list) else str(path)
        if isinstance(event, dict) and "specversion" in event:
            _keep_event(event, where, events, skipped)
        else:
            skipped.add("not_a_record", where, "a JSON value that is not a CloudEvent")


def _event_data(doc: dict[str, Any]) -> tuple[bytes, str]:
    content_type = str(doc.get("datacontenttype") or "application/json")
    if "data_base64" in doc:
        try:
            return base64.b64decode(doc["data_base64"]), content_type
        except ValueError:
            return b"", content_type
    data = doc.get("data")
    if data is None:
        return b"", content_type
    if isinstance(data, str) and "json" not in content_type:
        return data.encode(), content_type
    return json.dumps(data, separators=(",", ":")).encode(), content_type


def _pair(events: dict[str, dict[str, Any]], skipped: Skipped) -> Iterator[Recorded]:
    pairs = []
    for event_id, pair in events.items():
        if REQUEST_EVENT not in pair:
            _, where = pair[RESPONSE_EVENT]
            skipped.add(
                "no_request_body", where, f"event {event_id}: an answer without its request"
            )
            continue
        request_doc, where = pair[REQUEST_EVENT]
        request, request_type = _event_data(request_doc)
        response = response_type = None
        status = 0  # no answer event: not a 200 (KServe sends answers of 200s only)
        if RESPONSE_EVENT in pair:
            response, response_type = _event_data(pair[RESPONSE_EVENT][0])
            status = 200
        when = _seconds(request_doc.get("time"))
        pairs.append(
            Recorded(
                id=event_id,
                model=str(request_doc.get("inferenceservicename", "")),
                version=str(request_doc.get("endpoint", "")),
                api="",
                op="",
                when=when,
                microsec=0,
                request=request,
                request_type=request_type,
                status=status,
                response=response,
                response_type=response_type or "",
                where=where,
            )
        )
    pairs.sort(key=lambda r: r.when)
    yield from pairs
