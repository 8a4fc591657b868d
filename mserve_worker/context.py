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

import collections
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

from .protocol import METRIC_TYPES

# Units TorchServe accepts for the typed helpers; add_metric takes any unit.
_TIME_UNITS = ("ms", "s")
_SIZE_UNITS = ("MB", "kB", "GB", "B")
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


class Metrics:
    """Custom metrics a handler records; the runtime drains them after each batch.

    Each entry is a plain dict: ``name``, ``value`` (int or float), ``unit``, ``kind`` (``time``,
    ``counter``, ``size``, ``percent`` or ``metric``), ``request_id`` (None when no ``idx`` was
    given) and ``dimensions`` (a list of ``[name, value]`` pairs). At most ``max_entries`` are
    kept; the oldest go first and :attr:`dropped` counts them.
    """

    def __init__(self, max_entries: int = 1000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_entries)
        # None: not read yet this batch, asked of ``_ids_of`` (the context's) when a metric names
        # a request; most batches record no per-request metric
        self._request_ids: Mapping[int, str] | None = {}
        self._ids_of: Callable[[], Mapping[int, str]] | None = None
        self._cache: dict[tuple[str, str], CachedMetric] = {}
        self.dropped = 0

    def set_request_ids(self, request_ids: Mapping[int, str]) -> None:
        """Tell the metrics which request each batch index is (the runtime does, per batch)."""
        self._request_ids = dict(request_ids)

    def add_time(
        self,
        name: str,
        value: float,
        idx: int | None = None,
        unit: str = "ms",
        dimensions: Iterable[Any] | None = None,
        metric_type: Any = None,
    ) -> None:
        if unit not in _TIME_UNITS:
            raise ValueError(
                f"time metric {name!r}: unit must be one of {_TIME_UNITS}, got {unit!r}"
            )
        self._add("time", name, value, unit, idx, dimensions, metric_type=metric_type)

    def add_counter(
        self,
        name: str,
        value: float,
        idx: int | None = None,
        dimensions: Iterable[Any] | None = None,
        metric_type: Any = None,
    ) -> None:
        self._add("counter", name, value, "count", idx, dimensions, metric_type=metric_type)

    def add_size(
        self,
        name: str,
        value: float,
        idx: int | None = None,
        unit: str = "MB",
        dimensions: Iterable[Any] | None = None,
        metric_type: Any = None,
    ) -> None:
        if unit not in _SIZE_UNITS:
            raise ValueError(
                f"size metric {name!r}: unit must be one of {_SIZE_UNITS}, got {unit!r}"
            )
        self._add("size", name, value, unit, idx, dimensions, metric_type=metric_type)

    def add_percent(
        self,
        name: str,
        value: float,
        idx: int | None = None,
        dimensions: Iterable[Any] | None = None,
        metric_type: Any = None,
    ) -> None:
        self._add("percent", name, value, "percent", idx, dimensions, metric_type=metric_type)

    def add_metric(
        self,
        name: str,
        value: float,
        *args: Any,
        idx: int | None = None,
        unit: str | None = "",
        dimensions: Iterable[Any] | None = None,
        metric_type: Any = None,
    ) -> None:
        """A metric of any unit. Positional arguments after ``value`` follow either of
        TorchServe's orders: ``unit, idx, dimensions, metric_type`` (0.8 on) or ``idx, unit,
        dimensions`` (up to 0.7); a unit is text and an index a number, so the first tells them
        apart. ``metric_type`` (here and in the other ``add_*``) is accepted for TorchServe's
        signatures."""
        if args:
            modern = isinstance(args[0], str)
            order = ("unit", "idx") if modern else ("idx", "unit")
            names = (*order, "dimensions", "metric_type")
            if len(args) > len(names):
                raise TypeError(
                    f"metric {name!r}: add_metric takes at most {len(names) + 2} positional "
                    f"arguments (name, value, {', '.join(names)}), got {len(args) + 2}"
                )
            given = dict(zip(names, args))
            idx = given.get("idx", idx)
            unit = given.get("unit", unit)
            dimensions = given.get("dimensions", dimensions)
            metric_type = given.get("metric_type", metric_type)
        unit_text = "" if unit is None else str(unit)
        self._add("metric", name, value, unit_text, idx, dimensions, metric_type=metric_type)

    def add_metric_to_cache(
        self,
        metric_name: str,
        unit: str = "",
        dimension_names: Iterable[str] | None = None,
        metric_type: Any = None,
    ) -> CachedMetric:
        """Define a metric once and update it later (TorchServe 0.8's API): the object returned
        (also by :meth:`get_metric`) records a value with ``add_or_update`` or ``update``."""
        metric = CachedMetric(self, metric_name, unit, dimension_names, metric_type)
        self._cache[(metric_name, _type_name(metric_type))] = metric
        return metric

    def get_metric(self, metric_name: str, metric_type: Any = None) -> CachedMetric:
        """The metric :meth:`add_metric_to_cache` defined under this name and type."""
        try:
            return self._cache[(metric_name, _type_name(metric_type))]
        except KeyError:
            raise KeyError(
                f"metric {metric_name!r} of type {_type_name(metric_type)} is not defined; "
                f"call add_metric_to_cache first (defined: "
                f"{', '.join(sorted(n for n, _ in self._cache)) or 'none'})"
            ) from None

    def drain(self) -> list[dict[str, Any]]:
        """Return the recorded entries, oldest first, and forget them."""
        entries = list(self._entries)
        self._entries.clear()
        return entries

    def __len__(self) -> int:
        return len(self._entries)

    def _add(
        self,
        kind: str,
        name: str,
        value: Any,
        unit: str,
        idx: int | None,
        dimensions: Iterable[Any] | None,
        request_id: str | None = None,
        metric_type: Any = None,
    ) -> None:
        """Record one entry; ``metric_type`` (TorchServe's ``MetricTypes`` or its text) travels
        as the entry's ``type`` only when given, so the server's own choice stays the default."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"metric name must be a non-empty str, got {name!r}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"metric {name!r}: value must be a number, got {type(value).__name__} {value!r}"
            )
        number = int(value) if isinstance(value, numbers.Integral) else float(value)
        if idx is not None:
            ids = self._request_ids
            if ids is None:
                ids = self._request_ids = dict(self._ids_of()) if self._ids_of else {}
            if idx not in ids:
                raise IndexError(
                    f"metric {name!r}: idx {idx!r} is not a request of this batch "
                    f"(batch has {len(ids)} requests)"
                )
            request_id = ids[idx]
        entry = {
            "name": name,
            "value": number,
            "unit": unit,
            "kind": kind,
            "request_id": request_id,
            "dimensions": _dimension_pairs(name, dimensions),
        }
        if metric_type is not None:
            type_name = _type_name(metric_type)
            if type_name not in METRIC_TYPES:
                raise ValueError(
                    f"metric {name!r}: metric_type must be one of {METRIC_TYPES}"
                    f" (or TorchServe's MetricTypes), got {metric_type!r}"
                )
            entry["type"] = type_name
        if len(self._entries) == self._entries.maxlen:
            self.dropped += 1
        self._entries.append(entry)


def _type_name(metric_type: Any) -> str:
    """``MetricTypes.GAUGE``, ``"gauge"`` -> ``"gauge"``; TorchServe's default is counter."""
    if metric_type is None:
        return "counter"
    return str(getattr(metric_type, "value", metric_type)).lower()


class CachedMetric:
    """A metric defined by ``add_metric_to_cache``: its name, unit and dimension names fixed,
    a value and the dimension values given at each update (TorchServe's ``CachingMetric``)."""

    def __init__(
        self,
        metrics: Metrics,
        name: str,
        unit: str,
        dimension_names: Iterable[str] | None,
        metric_type: Any = None,
    ) -> None:
        self._metrics = metrics
        self.metric_type = metric_type
        self.metric_name = name
        self.unit = unit
        self.dimension_names = [str(n) for n in dimension_names or ()]

    def add_or_update(
        self,
        value: float,
        dimension_values: Iterable[Any] | None = None,
        request_id: str | None = "",
    ) -> None:
        values = [str(v) for v in dimension_values or ()]
        if len(values) != len(self.dimension_names):
            raise ValueError(
                f"metric {self.metric_name!r} has dimensions {self.dimension_names}, but "
                f"{len(values)} values were given: {values}"
            )
        pairs = [[n, v] for n, v in zip(self.dimension_names, values)]
        self._metrics._add(
            "metric",
            self.metric_name,
            value,
            self.unit,
            None,
            pairs,
            request_id or None,
            metric_type=self.metric_type,
        )

    def update(
        self, value: float, request_id: str | None = "", dimensions: Iterable[Any] | None = None
    ) -> None:
        """The older form: ``dimensions`` as ``Dimension`` objects (or pairs)."""
        pairs = _dimension_pairs(self.metric_name, dimensions)
        self.add_or_update(value, [v for _, v in pairs], request_id)


def _dimension_pairs(metric: str, dimensions: Iterable[Any] | None) -> list[list[str]]:
    """Accept ``[(name, value), ...]``, a mapping, or objects with ``.name`` and ``.value``."""
    if dimensions is None:
        return []
    items = dimensions.items() if isinstance(dimensions, Mapping) else dimensions
    pairs = []
    for item in items:
        if hasattr(item, "name") and hasattr(item, "value"):
            pairs.append([str(item.name), str(item.value)])
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            pairs.append([str(item[0]), str(item[1])])
        else:
            raise ValueError(
                f"metric {metric!r}: a dimension must be a (name, value) pair, got {item!r}"
            )
    return pairs


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
