"""What a handler sees as ``context.metrics``: TorchServe's metrics API (``add_time``,
``add_counter``, ``add_size``, ``add_percent``, ``add_metric`` and the cached metric objects of
``get_metric``/``add_metric_to_cache``), recorded per batch and sent to the server with its
answer (docs/protocol.md). Runs inside a worker process, in the model's own Python environment:
standard library only, Python 3.8+, nothing done at import time.
"""

from __future__ import annotations

import collections
import copy
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .protocol import METRIC_TYPES

# Units TorchServe accepts for the typed helpers; add_metric takes any unit.
_TIME_UNITS = ("ms", "s")
_SIZE_UNITS = ("MB", "kB", "GB", "B")


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

    def for_batch(self) -> Metrics:
        """Metrics of its own for one of several batches running at once (mserve_worker/
        inflight.py), with the metrics defined so far bound to it: what that batch records is
        drained with its answer, not another's."""
        other = Metrics(self._entries.maxlen or 1000)
        for key, metric in self._cache.items():
            bound = copy.copy(metric)
            bound._metrics = other
            other._cache[key] = bound
        return other

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
        cached: bool = False,
    ) -> None:
        """Record one entry; ``metric_type`` (TorchServe's ``MetricTypes`` or its text) travels
        as the entry's ``type`` only when given, so the server's own choice stays the default.
        ``cached``: a metric defined with ``add_metric_to_cache``, which TorchServe gives no
        dimension it did not name (the others get ``ModelName`` and ``Level`` on the server)."""
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
        if cached:
            entry["cached"] = True
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
            cached=True,
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
