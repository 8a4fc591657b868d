"""One logged request: its :class:`Record`, the JSON line a file gets and the CloudEvents an
HTTP receiver gets.

A record keeps the bodies as they travelled; decoding, redaction and encoding happen in the
sink's task, off the request path. The JSON line uses mlrun's stream field names (``request``,
``op``, ``resp``, ``when``, ``microsec``, ``metrics``, ``error``); the CloudEvents are KServe's
logger's, attribute for attribute (docs/inference-logging.md).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable
from datetime import datetime, timezone
from json.encoder import encode_basestring_ascii as _quoted  # what json.dumps writes for a str
from typing import Any
from urllib.parse import quote

from mserve_worker.payload import is_json  # what the worker parses as JSON

# KServe's event types (pkg/logger: CEInferenceRequest, CEInferenceResponse)
REQUEST_EVENT = "org.kubeflow.serving.inference.request"
RESPONSE_EVENT = "org.kubeflow.serving.inference.response"
REDACTED = "[redacted]"


class Record:
    """One sampled request and how it ended (a plain class with slots: made per request)."""

    __slots__ = (
        "api", "arrived", "error", "id", "logged", "microsec", "op", "request_body",
        "request_id", "request_type", "response_body", "response_json", "response_type",
        "status", "tenant",
    )  # fmt: skip

    def __init__(
        self, request_id: str, event_id: str, api: str, op: str, arrived: float, microsec: int,
        request_type: str, request_body: bytes, status: int, response_type: str,
        response_body: bytes, error: str | None, logged: dict[str, Any] | None,
        response_json: bool = False, tenant: str | None = None,
    ) -> None:  # fmt: skip
        self.request_id = request_id
        self.id = event_id  # the client's ce-id header, else our request id (X-Request-Id)
        self.api = api
        self.op = op
        self.arrived = arrived  # wall-clock time the request arrived
        self.microsec = microsec  # from arrival to answer
        self.request_type = request_type
        self.request_body = request_body
        self.status = status
        self.response_type = response_type
        self.response_body = response_body
        self.error = error
        # what a v2 model class chose to log (mlrun's logged_results): request, resp, metrics,
        # error, op, class, worker; None for the other handler styles
        self.logged = logged
        # the worker encoded the response body as JSON itself (ResponseItem.json_body)
        self.response_json = response_json
        self.tenant = tenant  # who sent it, while the server has tenants (server/tenants/)


class Encoder:
    """Turns records into JSON lines and CloudEvents for one model version."""

    def __init__(
        self, model: str, version: str, redact: Iterable[str], source: str, namespace: str,
        component: str = "predictor",
    ) -> None:  # fmt: skip
        self.model = model
        self.version = version
        self._keys = frozenset(r for r in redact if not r.startswith("/"))
        self._pointers = [_pointer(r) for r in redact if r.startswith("/")]
        self.source = source
        self.namespace = namespace
        self.component = component
        # what every line and event of this model version repeats, encoded once
        self._line_model = f'"model":{_quoted(model)},"version":{_quoted(version)},'
        self._ce_source = _ce(source)
        # KServe's extension attributes (pkg/logger/worker.go)
        self._ce_extensions = (
            f"ce-inferenceservicename: {_ce(model)}\r\nce-namespace: {_ce(namespace)}\r\n"
            f"ce-component: {_ce(component)}\r\nce-endpoint: {_ce(version)}\r\n"
            f"ce-metadata: {_ce('{}')}\r\n"
        )

    # --- bodies ---------------------------------------------------------------------------

    def value(self, content_type: str, body: bytes) -> Any:
        """A body as a JSON value, redacted: parsed JSON, else text, else ``{"base64": ...}``."""
        if not body:
            return None
        data = bytes(body)
        if "json" in content_type or (not content_type and data[:1] in (b"{", b"[")):
            try:
                return self.redacted(json.loads(data))
            except ValueError:
                pass
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(data).decode("ascii")}

    def value_text(
        self, content_type: str, body: bytes, parsed: bool = False, encoded: bool = False
    ) -> str:
        """:meth:`value` as JSON text. A JSON body with nothing to redact goes in as it came,
        its line breaks made spaces (in valid JSON a raw line break is whitespace between
        tokens): encoding a parsed body again cost ~100 us per record for 256 floats, more
        than the request itself. ``parsed``: the worker parsed it (a JSON request it did not
        refuse), so it is not checked again; ``encoded``: the worker wrote it with its JSON
        encoder (compact, no raw line breaks), so it is not checked at all (checking the
        answer cost ~45 us per record for 256 floats)."""
        if body and not (self._keys or self._pointers) and "json" in content_type:
            data = bytes(body)
            try:
                text = data.decode("utf-8")
                if encoded:
                    return text
                if not (parsed and is_json(content_type.split(";")[0].strip().lower())):
                    json.loads(data)
            except ValueError:  # UnicodeDecodeError included
                pass
            else:
                return text.replace("\n", " ").replace("\r", " ")
        return json.dumps(self.value(content_type, body), separators=(",", ":"))

    def redacted(self, value: Any) -> Any:
        """``value`` with the configured keys (at any depth) and JSON pointers replaced."""
        if self._keys:
            value = _without_keys(value, self._keys)
        for pointer in self._pointers:
            _replace_at(value, pointer)
        return value

    def _event_body(self, content_type: str, body: bytes) -> bytes:
        """A body as an event's data: as sent, unless redaction changes a JSON body."""
        data = bytes(body)
        if not (self._keys or self._pointers) or "json" not in content_type:
            return data
        try:
            return json.dumps(self.redacted(json.loads(data))).encode()
        except ValueError:
            return data

    # --- files ----------------------------------------------------------------------------

    def line(self, record: Record, requests: bool = True, responses: bool = True) -> str:
        """The record's JSON line (mlrun's stream field names, plus ours); the mode leaves
        out the request (``response``) or the response (``request``)."""
        logged = record.logged
        if logged is None:
            return self._plain_line(record, requests, responses)
        out: dict[str, Any] = {
            "id": record.id,
            "request_id": record.request_id,
            "model": self.model,
            "version": self.version,
            "api": record.api or "torchserve",
            "op": record.op or "predict",
            "when": _iso(record.arrived),
            "microsec": record.microsec,
            "status": record.status,
        }
        if record.tenant is not None:
            out["tenant"] = record.tenant
        out["request"] = self.redacted(logged.get("request"))
        if "resp" in logged:
            out["resp"] = self.redacted(logged["resp"])
        for key in ("op", "class", "worker", "metrics", "error"):
            if logged.get(key) not in (None, {}, ""):
                out[key] = logged[key]
        if record.error is not None and "error" not in out:
            out["error"] = record.error
        if not requests:
            out.pop("request", None)
        if not responses:
            out.pop("resp", None)
        return json.dumps(out, separators=(",", ":"), default=str)

    def _plain_line(self, record: Record, requests: bool, responses: bool) -> str:
        """:meth:`line` of a record without a v2 class's choice: the same fields in the same
        order, written directly (json.dumps of the dict cost ~6 us more per record) and the
        bodies spliced in as JSON text (see value_text)."""
        error = "" if record.error is None else f',"error":{_quoted(record.error)}'
        if record.tenant is not None:  # a tenant's name: letters, digits, . _ - (no escapes)
            error = f',"tenant":"{record.tenant}"{error}'
        text = (
            f'{{"id":{_quoted(record.id)},"request_id":{_quoted(record.request_id)},'
            f'{self._line_model}"api":{_quoted(record.api or "torchserve")},'
            f'"op":{_quoted(record.op or "predict")},"when":"{_iso(record.arrived)}",'
            f'"microsec":{int(record.microsec)},"status":{int(record.status)}{error}'
        )
        if requests:
            body = self.value_text(record.request_type, record.request_body, record.status < 400)
            text = f'{text},"request":{body}'
        if responses:
            body = self.value_text(record.response_type, record.response_body,
                                   encoded=record.response_json)  # fmt: skip
            text = f'{text},"resp":{body}'
        return text + "}"

    # --- CloudEvents ----------------------------------------------------------------------

    def events(
        self, record: Record, requests: bool, responses: bool, time: str | None = None
    ) -> list[_Message]:
        """The record's CloudEvents in binary content mode, as KServe's logger sends them: the
        request's, then the response's (only for a 200, as KServe does), paired by id.
        ``time``: their ``ce-time`` (:func:`event_time`; a sink stamps a batch it makes at
        once with one), else now."""
        out = []
        logged = record.logged
        content_type = record.request_type or "application/octet-stream"
        shared = (_ce(record.id), event_time() if time is None else time)
        metrics = ""
        if logged is not None and logged.get("metrics"):
            metrics = f"ce-metrics: {_ce(json.dumps(logged['metrics'], default=str))}\r\n"
        if record.tenant is not None:  # an extension attribute of ours
            metrics += f"ce-tenant: {record.tenant}\r\n"
        if requests:
            if logged is not None:
                data = _json_bytes(self.redacted(logged.get("request")))
                content_type = "application/json"
            else:
                data = self._event_body(record.request_type, record.request_body)
            out.append(self._message(REQUEST_EVENT, shared, content_type, metrics, data))
        if responses and record.status == 200:
            if logged is not None and "resp" in logged:
                data = _json_bytes(self.redacted(logged["resp"]))
                content_type = "application/json"
            else:
                # KServe labels it with the request's content type; the answer's own is right
                # where they differ (a gRPC form in, JSON out)
                content_type = record.response_type or content_type
                data = self._event_body(record.response_type, record.response_body)
            out.append(self._message(RESPONSE_EVENT, shared, content_type, metrics, data))
        return out

    def _message(
        self, kind: str, shared: tuple[str, str], content_type: str, metrics: str, data: bytes
    ) -> _Message:
        """The event in binary content mode, header for header (in the same order) what the
        ``cloudevents`` SDK's ``to_binary_event`` makes of the same attributes (tests/server/
        test_inference_log.py compares them), without its event object's validation (~30 us
        of the frontend's CPU per event), written as the header lines the sender sends (a
        dict joined into lines cost ~10 us more per event)."""
        ce_id, ce_time = shared
        if (
            "\r" in content_type or "\n" in content_type
        ):  # a handler's own type, never a header break
            content_type = "application/octet-stream"
        return _Message(
            f"ce-id: {ce_id}\r\nce-type: {kind}\r\nce-source: {self._ce_source}\r\n"
            f"content-type: {content_type}\r\nce-time: {ce_time}\r\n{self._ce_extensions}"
            f"{metrics}ce-specversion: 1.0\r\n",
            data,
        )


class _Message:
    """An event in binary content mode: its header lines (``name: value``, each ending in
    CRLF) and its body, what ``to_binary_event``'s HTTPMessage holds."""

    __slots__ = ("body", "head")

    def __init__(self, head: str, body: bytes) -> None:
        self.head = head
        self.body = body

    @property
    def headers(self) -> dict[str, str]:
        """The header lines as a dict, in their order (for tests and readers; the sender sends
        :attr:`head`)."""
        pairs = (line.split(": ", 1) for line in self.head.split("\r\n") if line)
        return {name: value for name, value in pairs}


# what the CloudEvents HTTP binding leaves unencoded in a header value (printable ASCII but
# space, double quote and percent: its section 3.1.3.2)
_CE_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"%')


_CE_UNSAFE = re.compile(r'[^\x21-\x7e]|["%]')


def _ce(value: str) -> str:
    """A ce- header's value, percent-encoded as the binding says (most need nothing: a
    request id, a time)."""
    if _CE_UNSAFE.search(value) is None:
        return value
    return quote(value, safe=_CE_SAFE)


def event_time() -> str:
    """Now as a ``ce-time`` value (RFC 3339 UTC, as the SDK writes it)."""
    now = datetime.now(timezone.utc).isoformat()
    return _ce(now[:-6] + "Z" if now.endswith("+00:00") else now)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat()


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), default=str).encode()


def _without_keys(value: Any, keys: frozenset[str]) -> Any:
    if isinstance(value, dict):
        return {k: REDACTED if k in keys else _without_keys(v, keys) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_keys(v, keys) for v in value]
    return value


def _pointer(text: str) -> list[str]:
    """RFC 6901: ``/a/0/b~1c`` -> ``["a", "0", "b/c"]``."""
    return [p.replace("~1", "/").replace("~0", "~") for p in text.split("/")[1:]]


def _replace_at(value: Any, path: list[str]) -> None:
    """Replace what ``path`` names in ``value`` (in place); a path that names nothing is
    ignored, as a body need not have every field."""
    where = value
    for part in path[:-1]:
        where = _child(where, part)
        if where is None:
            return
    last = path[-1] if path else None
    if isinstance(where, dict) and last in where:
        where[last] = REDACTED
    elif isinstance(where, list) and last is not None and last.isdigit() and int(last) < len(where):
        where[int(last)] = REDACTED


def _child(value: Any, part: str) -> Any:
    if isinstance(value, dict):
        return value.get(part)
    if isinstance(value, list) and part.isdigit() and int(part) < len(value):
        return value[int(part)]
    return None
