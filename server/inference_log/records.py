"""One logged request: its :class:`Record`, the JSON line a file gets and the CloudEvents an
HTTP receiver gets.

A record keeps the bodies as they travelled; decoding, redaction and encoding happen in the
sink's task, off the request path. The JSON line uses mlrun's stream field names (``request``,
``op``, ``resp``, ``when``, ``microsec``, ``metrics``, ``error``); the CloudEvents are KServe's
logger's, attribute for attribute (docs/server.md, Inference logging).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from mserve_worker.payload import _is_json  # what the worker parses as JSON

if TYPE_CHECKING:
    from cloudevents.core.bindings.http import HTTPMessage

# KServe's event types (pkg/logger: CEInferenceRequest, CEInferenceResponse)
REQUEST_EVENT = "org.kubeflow.serving.inference.request"
RESPONSE_EVENT = "org.kubeflow.serving.inference.response"
REDACTED = "[redacted]"


class Record:
    """One sampled request and how it ended (a plain class with slots: made per request)."""

    __slots__ = (
        "api", "arrived", "error", "id", "logged", "microsec", "op", "request_body",
        "request_id", "request_type", "response_body", "response_type", "status",
    )  # fmt: skip

    def __init__(
        self, request_id: str, event_id: str, api: str, op: str, arrived: float, microsec: int,
        request_type: str, request_body: bytes, status: int, response_type: str,
        response_body: bytes, error: str | None, logged: dict[str, Any] | None,
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

    def value_text(self, content_type: str, body: bytes, parsed: bool = False) -> str:
        """:meth:`value` as JSON text. A JSON body with nothing to redact goes in as it came,
        its line breaks made spaces (in valid JSON a raw line break is whitespace between
        tokens): encoding a parsed body again cost ~100 us per record for 256 floats, more
        than the request itself. ``parsed``: the worker parsed it (a JSON request it did not
        refuse), so it is not checked again."""
        if body and not (self._keys or self._pointers) and "json" in content_type:
            data = bytes(body)
            try:
                if not (parsed and _is_json(content_type.split(";")[0].strip().lower())):
                    json.loads(data)
                text = data.decode("utf-8")
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
        logged = record.logged
        if logged is not None:
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
        text = json.dumps(out, separators=(",", ":"), default=str)
        if logged is not None:
            return text
        bodies = []  # spliced in as JSON text (see value_text)
        if requests:
            body = self.value_text(record.request_type, record.request_body, record.status < 400)
            bodies.append(f'"request":{body}')
        if responses:
            bodies.append(f'"resp":{self.value_text(record.response_type, record.response_body)}')
        return f"{text[:-1]},{','.join(bodies)}}}" if bodies else text

    # --- CloudEvents ----------------------------------------------------------------------

    def events(self, record: Record, requests: bool, responses: bool) -> list[HTTPMessage]:
        """The record's CloudEvents in binary content mode, as KServe's logger sends them: the
        request's, then the response's (only for a 200, as KServe does), paired by id."""
        out = []
        logged = record.logged
        content_type = record.request_type or "application/octet-stream"
        if requests:
            if logged is not None:
                data = _json_bytes(self.redacted(logged.get("request")))
                content_type = "application/json"
            else:
                data = self._event_body(record.request_type, record.request_body)
            out.append(self._message(REQUEST_EVENT, record, content_type, data, logged))
        if responses and record.status == 200:
            if logged is not None and "resp" in logged:
                data = _json_bytes(self.redacted(logged["resp"]))
                content_type = "application/json"
            else:
                # KServe labels it with the request's content type; the answer's own is right
                # where they differ (a gRPC form in, JSON out)
                content_type = record.response_type or content_type
                data = self._event_body(record.response_type, record.response_body)
            out.append(self._message(RESPONSE_EVENT, record, content_type, data, logged))
        return out

    def _message(
        self, kind: str, record: Record, content_type: str, data: bytes,
        logged: dict[str, Any] | None,
    ) -> HTTPMessage:  # fmt: skip
        # imported here: only a server that sends CloudEvents pays for it
        from cloudevents.core.bindings.http import to_binary_event
        from cloudevents.core.v1.event import CloudEvent

        attributes: dict[str, Any] = {
            "id": record.id,
            "type": kind,
            "source": self.source,
            "datacontenttype": content_type,
            "time": datetime.now(timezone.utc),
            # KServe's extension attributes (pkg/logger/worker.go)
            "inferenceservicename": self.model,
            "namespace": self.namespace,
            "component": self.component,
            "endpoint": self.version,
            "metadata": "{}",
        }
        if logged is not None and logged.get("metrics"):
            attributes["metrics"] = json.dumps(logged["metrics"], default=str)
        return to_binary_event(CloudEvent(attributes, data))


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
