"""What a handler sees as ``context``: model facts, per-request headers and response settings.

This runs inside a worker process, in the model's own Python environment: standard library only,
Python 3.8+, nothing done at import time.

The attribute and method names are the ones TorchServe and MMS handlers already call
(``context.system_properties["gpu_id"]``, ``context.get_request_header(0, "x-id")``,
``context.set_response_status(404, "no such user", idx=1)``, ``context.metrics.add_time(...)``).
The runtime calls :meth:`Context.start_batch` before each batch and reads the response settings
back with the ``get_response_*`` methods after the handler returns.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

from .metrics import Metrics

_CONTENT_TYPE = "content-type"


def _text(value: Any) -> str:
    """A header name or value as ``str``; the protocol may hand us bytes."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)


class RequestProcessor:
    """One request of the batch: its headers in, the status and headers it should get out.

    ``context.request_processor[idx]`` is one of these, for handlers written against TorchServe's
    object of that name. Header lookups ignore case; repeated request headers are joined with
    ``", "`` as HTTP allows.
    """

    def __init__(
        self,
        request_id: str,
        headers: Iterable[Sequence[Any]] | Callable[[], Iterable[Sequence[Any]]] | None = (),
        body: bytes | bytearray | memoryview = b"",
    ) -> None:
        self.request_id = request_id
        self.body = body  # as the client sent it; valid while its batch runs
        # The header lookup is built at the first question: most handlers never ask, and every
        # request of every batch gets one of these. ``headers`` may be a callable returning the
        # pairs (start_batch: a packed BATCH entry's are split only when read; protocol.py).
        self._raw_headers = headers
        self._indexed: tuple[dict[str, str], dict[str, str]] | None = None
        self._status_code = 200
        self._reason_phrase = ""
        self._content_type: str | None = None
        self._response_headers: dict[str, str] = {}

    def _index(self) -> tuple[dict[str, str], dict[str, str]]:
        """(original spelling of the first occurrence -> value, lower-case -> that spelling)."""
        if self._indexed is not None:
            return self._indexed
        headers: dict[str, str] = {}
        names: dict[str, str] = {}
        raw = self._raw_headers
        for pair in (raw() if callable(raw) else raw) or ():
            name, value = pair[0], pair[1]
            if type(name) is not str or type(value) is not str:  # the protocol sends str
                name, value = _text(name), _text(value)
            key = name.lower()
            if key in names:
                first = names[key]
                headers[first] = headers[first] + ", " + value
            else:
                names[key] = name
                headers[name] = value
        self._indexed = headers, names
        return self._indexed

    # Request side.
    def get_request_property(self, key: str) -> str | None:
        headers, names = self._index()
        name = names.get(key.lower())
        return None if name is None else headers[name]

    def get_request_properties(self) -> dict[str, str]:
        return dict(self._index()[0])

    # Response side.
    def report_status(self, code: int, reason_phrase: str | None = "") -> None:
        if isinstance(code, bool) or not isinstance(code, int) or not 100 <= code <= 599:
            raise ValueError(f"response status must be an int from 100 to 599, got {code!r}")
        self._status_code = code
        self._reason_phrase = "" if reason_phrase is None else str(reason_phrase)

    def get_response_status_code(self) -> int:
        return self._status_code

    def get_response_status_phrase(self) -> str:
        return self._reason_phrase

    def add_response_property(self, key: str, value: str) -> None:
        """Set a response header; ``Content-Type`` goes to the content-type slot instead."""
        name = str(key)
        if name.lower() == _CONTENT_TYPE:
            self._content_type = str(value)
            return
        headers = self._response_headers
        if headers:  # one per name, whatever its case (none yet: the usual case, no scan)
            lower = name.lower()
            for existing in [k for k in headers if k.lower() == lower]:
                del headers[existing]
        headers[name] = str(value)

    def get_response_headers(self) -> dict[str, str]:
        """Response headers the handler set, without ``Content-Type`` (see content type)."""
        return dict(self._response_headers)

    def response_header_pairs(self) -> list[list[str]]:
        """The headers the handler set as the wire's ``[name, value]`` pairs (no content type)."""
        if not self._response_headers:
            return []
        return [[k, v] for k, v in self._response_headers.items()]

    def get_response_header(self, key: str) -> str | None:
        if key.lower() == _CONTENT_TYPE:
            return self._content_type
        for name, value in self._response_headers.items():
            if name.lower() == key.lower():
                return value
        return None

    def get_response_content_type(self) -> str | None:
        return self._content_type


class Context:
    """The ``context`` argument of ``handle(data, context)``.

    Model-level facts are fixed at load time; per-request state is replaced by
    :meth:`start_batch`. ``idx`` is always the request's index in the batch list.
    """

    def __init__(
        self,
        model_name: str,
        model_dir: str,
        manifest: dict[str, Any],
        batch_size: int,
        gpu_id: int | None,
        server_name: str,
        server_version: str,
        limit_max_image_pixels: bool = True,
        model_yaml_config: dict[str, Any] | None = None,
        metrics: Any = None,
        model_version: str = "",
        worker_id: str = "",
    ) -> None:
        self.model_name = model_name
        self.model_version = model_version
        self.worker_id = worker_id
        # What the current batch asks for: "" (predict), "explain", or a custom operation name.
        # The runtime calls the handler once per operation, so one value holds for the batch.
        self.operation = ""
        # The API of the current call's requests: "" (TorchServe's paths, or a v1/v2 body handed
        # over as it came), "v2" (decoded Open Inference Protocol tensors) or "v1" (KServe v1).
        self.protocol = ""
        self.manifest = manifest
        self.system_properties: dict[str, Any] = {
            "model_dir": model_dir,
            "gpu_id": gpu_id,
            "batch_size": batch_size,
            "server_name": server_name,
            "server_version": server_version,
            "limit_max_image_pixels": limit_max_image_pixels,
        }
        self.model_yaml_config: dict[str, Any] = (
            dict(model_yaml_config) if model_yaml_config else {}
        )
        self.metrics = Metrics() if metrics is None else metrics
        # The current batch; its request processors and id map are made when first read (most
        # handlers read neither: a batch then costs no object per request here).
        self._batch: Sequence[Any] = ()
        self._processors: list[RequestProcessor] | None = []
        self._ids: dict[int, str] | None = {}
        # Generative and stateful handlers (TorchServe's): per-request state kept between the
        # steps of continuous batching, and one callable per request saying whether it is done
        # (mserve_worker/continuous.py).
        self.cache: dict[Any, Any] = {}
        self.stopping_criteria: Any = None
        # the request headers that carry a sequence's id, start and end (the server's
        # ts_header_key_sequence_*)
        self.header_key_sequence_id = "ts_request_sequence_id"
        self.header_key_sequence_start = "ts_request_sequence_start"
        self.header_key_sequence_end = "ts_request_sequence_end"

    def start_batch(self, requests: Sequence[Any], operation: str = "") -> None:
        """Make ``requests`` (each with ``.request_id`` and ``.headers``) the current batch.

        Clears every response status, header and content type the previous batch set.
        """
        self.operation = operation
        self._batch = requests if type(requests) is list else list(requests)
        self._processors = None
        self._ids = None
        metrics = self.metrics
        if isinstance(metrics, Metrics):
            metrics._request_ids = None  # read from request_ids when a metric names a request
            metrics._ids_of = self._current_ids

    def for_batch(self) -> Context:
        """A copy for one of several batches running at once (mserve_worker/inflight.py), as
        TorchServe's async worker copies its context per batch: the model's facts and the
        handler's ``cache`` shared, the batch's requests, response settings and metrics its
        own (a handler's own attributes are shared: the copy is shallow)."""
        other = copy.copy(self)
        other.operation = other.protocol = ""
        other._batch, other._processors, other._ids = (), [], {}
        if isinstance(self.metrics, Metrics):
            other.metrics = self.metrics.for_batch()
        return other

    @property
    def request_processor(self) -> list[RequestProcessor]:
        """One :class:`RequestProcessor` per request of the batch, made at the first read."""
        processors = self._processors
        if processors is None:
            processors = self._processors = [
                RequestProcessor(
                    r.request_id, partial(getattr, r, "headers"), getattr(r, "body", b"")
                )
                for r in self._batch
            ]
        return processors

    @request_processor.setter
    def request_processor(self, value: list[RequestProcessor]) -> None:
        self._processors = value

    @property
    def request_ids(self) -> dict[int, str]:
        """``{index in the batch: request id}``, TorchServe's map, made at the first read."""
        ids = self._ids
        if ids is None:
            ids = self._ids = {i: r.request_id for i, r in enumerate(self._batch)}
        return ids

    @request_ids.setter
    def request_ids(self, value: dict[int, str]) -> None:
        self._ids = value

    def _current_ids(self) -> Mapping[int, str]:
        return self.request_ids

    def _touched(self, idx: int) -> RequestProcessor | None:
        """Request ``idx``'s processor when the handler made them (it read or set something per
        request); None when it did not: status 200, no header, no content type set."""
        processors = self._processors
        return None if processors is None else processors[idx]

    def _request(self, idx: int) -> RequestProcessor:
        count = len(self.request_processor)
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < count:
            raise IndexError(
                f"request index {idx!r} is out of range: the current batch has {count} "
                f"request{'' if count == 1 else 's'} (valid: 0 to {count - 1})"
                if count
                else f"request index {idx!r} is out of range: there is no current batch"
            )
        return self.request_processor[idx]

    # Requests.
    def get_request_id(self, idx: int = 0) -> str:
        return self._request(idx).request_id

    def get_request_header(self, idx: int, key: str) -> str | None:
        """The value of request header ``key`` (any case), or None when it was not sent."""
        return self._request(idx).get_request_property(key)

    def get_sequence_id(self, idx: int) -> str | None:
        """The sequence request ``idx`` belongs to (sequence batching), None outside one."""
        return self._request(idx).get_request_property(self.header_key_sequence_id)

    def trace_context(self, idx: int = 0) -> dict[str, str]:
        """Request ``idx``'s W3C trace context, ``{"traceparent": ..., "tracestate": ...}``
        (only the headers it has; empty when untraced): with the server tracing, the parent
        is the server's span of the request, else what the client sent. Pass it to
        OpenTelemetry's ``TraceContextTextMapPropagator().extract()`` or on to another
        service."""
        request = self._request(idx)
        found = {}
        for name in ("traceparent", "tracestate"):
            value = request.get_request_property(name)
            if value is not None:
                found[name] = value
        return found

    def get_all_request_header(self, idx: int) -> dict[str, str]:
        return self._request(idx).get_request_properties()

    def get_request_body(self, idx: int) -> bytes:
        """The body of request ``idx`` exactly as the client sent it (``data[idx]["body"]`` is
        the decoded form); for adapters whose contract hands over the raw text."""
        return bytes(self._request(idx).body)

    # Responses.
    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        self._request(idx).report_status(code, phrase)

    def error_response(self, idx: int, code: int, kind: str, message: str) -> dict[str, Any]:
        """Answer request ``idx`` alone with ``code`` and the body the server's own errors have
        (TorchServe's ``{"code", "type", "message"}``); return that body as its result."""
        self.set_response_status(code, message, idx)
        return {"code": code, "type": kind, "message": message}

    def set_all_response_status(self, code: int = 200, phrase: str = "") -> None:
        for request in self.request_processor:
            request.report_status(code, phrase)

    def get_response_status(self, idx: int) -> tuple[int, str]:
        """``(code, phrase)``; ``(200, "")`` unless the handler set it."""
        request = self._request(idx)
        return request.get_response_status_code(), request.get_response_status_phrase()

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        """Set one response header; setting ``Content-Type`` here equals
        :meth:`set_response_content_type`."""
        self._request(idx).add_response_property(key, value)

    def get_response_headers(self, idx: int) -> dict[str, str]:
        """Headers set for request ``idx``, without ``Content-Type``: that one is
        :meth:`get_response_content_type`, so the runtime sends it exactly once."""
        return self._request(idx).get_response_headers()

    def set_response_content_type(self, idx: int, value: str) -> None:
        self._request(idx).add_response_property(_CONTENT_TYPE, value)

    def get_response_content_type(self, idx: int) -> str | None:
        return self._request(idx).get_response_content_type()
