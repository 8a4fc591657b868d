"""Metrics handlers record through ``context.metrics``, aggregated for the whole server, and
the ``model_metrics`` a TorchServe metrics.yaml declares.

Counters add up, gauges keep the last value, histograms count each value into buckets, across
every worker and batch. Bounded: a handler that puts request ids or user input into dimensions
would otherwise grow the server's memory without end.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mserve_worker.protocol import MetricEntry
from server.config import read_yaml_mapping
from server.errors import ConfigError

log = logging.getLogger(__name__)

# A handler that invents label values (a request id, a user name) would grow these without end:
# past the cap a metric takes no new label sets, and the server says so once per metric.
MAX_SERIES_PER_METRIC = 1000
MAX_HANDLER_METRICS = 200  # distinct metric names handlers may create, all models together
# prometheus_client's (and the Java client's) default histogram buckets
BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    math.inf,
)
# How TorchServe writes a handler metric's unit in its log lines (ts/metrics/unit.py).
UNIT_NAMES = {
    "ms": "Milliseconds",
    "s": "Seconds",
    "percent": "Percent",
    "count": "Count",
    "MB": "Megabytes",
    "GB": "Gigabytes",
    "kB": "Kilobytes",
    "B": "Bytes",
    "": "unit",
}
_KIND_TYPES = {
    "counter": "counter",
    "metric": "counter",
    "time": "gauge",
    "size": "gauge",
    "percent": "gauge",
}


@dataclass
class Family:
    """One metric handlers update: its type, unit and label names (Hostname last)."""

    name: str
    type: str
    unit: str
    labels: tuple[str, ...]
    declared: bool = False  # from the metrics config's model_metrics
    series: dict[tuple[str, ...], list[float]] = field(default_factory=dict)
    warned: bool = False


@dataclass(frozen=True)
class MetricsConfig:
    """What a TorchServe metrics.yaml says: the handler metrics it declares, and which frontend
    metrics to emit (None: all; TorchServe emits only those its ``ts_metrics`` lists)."""

    model: dict[str, Family]
    frontend: frozenset[str] | None


def load_metrics_config(path: Path) -> MetricsConfig:
    data = read_yaml_mapping(
        path,
        cannot_read=f"metrics_config: cannot read {path}",
        invalid=f"metrics_config: {path} is not valid YAML",
        not_mapping=f"metrics_config: {path} should be a mapping with model_metrics",
    )
    frontend = None
    if data.get("ts_metrics") is not None:
        frontend = frozenset(f.name for f in _section(path, data, "ts_metrics"))
    model = {f.name: f for f in _section(path, data, "model_metrics")}
    return MetricsConfig(model, frontend)


def _section(path: Path, data: dict[str, Any], key: str) -> list[Family]:
    section = data.get(key) or {}
    if not isinstance(section, dict):
        raise ConfigError(f"metrics_config: {path}: {key} should map types to lists")
    families = []
    for kind, specs in section.items():
        if kind not in ("counter", "gauge", "histogram"):
            raise ConfigError(
                f"metrics_config: {path}: {key} type {kind!r} is not one of counter,"
                " gauge, histogram"
            )
        for i, spec in enumerate(specs or []):
            where = f"metrics_config: {path}: {key}.{kind}[{i}]"
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ConfigError(f"{where} should be a mapping with a name")
            dims = spec.get("dimensions") or []
            if not isinstance(dims, list) or not all(isinstance(d, str) for d in dims):
                raise ConfigError(f"{where}.dimensions should be a list of names, found {dims!r}")
            labels = (*(d for d in dims if d != "Hostname"), "Hostname")
            unit = str(spec.get("unit", ""))
            families.append(Family(spec["name"], kind, unit, labels, declared=True))
    return families


def default_families() -> dict[str, Family]:
    """TorchServe's default model_metrics: HandlerTime and PredictionTime."""
    labels = ("ModelName", "Level", "Hostname")
    return {
        name: Family(name, "gauge", "ms", labels, declared=True)
        for name in ("HandlerTime", "PredictionTime")
    }


class HandlerMetrics:
    """Metrics handlers record, aggregated over every worker of every model: counters add up,
    gauges keep the last value, histograms count each value into buckets."""

    def __init__(
        self, declared: dict[str, Family], hostname: str, auto_detect: bool = True
    ) -> None:
        """``auto_detect``: metrics ``declared`` lacks are added as handlers record them
        (TorchServe's model_metrics_auto_detect); else their values are dropped."""
        self.families = declared
        self.hostname = hostname
        self.auto_detect = auto_detect
        self._full_warned = False

    def series(self, family: Family, values: tuple[str, ...]) -> list[float] | None:
        """The stored values of one label set, created on first use; None past the cap."""
        found = family.series.get(values)
        if found is not None:
            return found
        if len(family.series) >= MAX_SERIES_PER_METRIC:
            if not family.warned:
                family.warned = True
                log.warning(
                    "metric %s has %d label sets, the most one metric may have: values with new"
                    " labels are dropped (a handler putting ids or free text in dimensions?)",
                    family.name, MAX_SERIES_PER_METRIC,
                )  # fmt: skip
            return None
        found = [0.0] * (len(BUCKETS) + 2) if family.type == "histogram" else [0.0]
        family.series[values] = found
        return found

    def family_for(self, entry: MetricEntry, labels: tuple[str, ...]) -> Family | None:
        family = self.families.get(entry.name)
        if family is not None:
            return family
        if not self.auto_detect:
            return None
        if len(self.families) >= MAX_HANDLER_METRICS:
            if not self._full_warned:
                self._full_warned = True
                log.warning(
                    "handlers created %d metrics, the most the server keeps: metric %s and"
                    " other new names are dropped", MAX_HANDLER_METRICS, entry.name,
                )  # fmt: skip
            return None
        kind = entry.type or _KIND_TYPES.get(entry.kind, "counter")
        unit = UNIT_NAMES.get(entry.unit, entry.unit)  # as TorchServe's backend names it
        family = self.families[entry.name] = Family(entry.name, kind, unit, labels)
        return family

    def add(self, model_name: str, entry: MetricEntry) -> tuple[Family, tuple[str, ...]] | None:
        """Apply one entry; the family and label values it went to (None when dropped)."""
        dims = dict(entry.dimensions)
        dims.pop("Hostname", None)
        names = [name for name, _value in entry.dimensions if name != "Hostname"]
        # TorchServe's default dimensions, in its order; a declared metric gets those it
        # declares, one its handler defined with add_metric_to_cache (declared or auto-detected)
        # none it did not name, as TorchServe's cached metrics carry none
        declared = self.families.get(entry.name)
        for name, value in (("ModelName", model_name), ("Level", "Model")):
            if entry.cached and declared is None:
                break
            if name not in dims and (declared is None or name in declared.labels):
                names.append(name)
                dims[name] = value
        family = self.family_for(entry, (*dict.fromkeys(names), "Hostname"))
        if family is None:
            return None
        try:
            values = (*(dims[name] for name in family.labels[:-1]), self.hostname)
        except KeyError:
            values = None
        if values is None or len(dims) != len(family.labels) - 1:
            if not family.warned:
                family.warned = True
                log.warning(
                    "metric %s: dimensions %s do not match its dimensions %s; value dropped",
                    entry.name, sorted(dims), list(family.labels[:-1]),
                )  # fmt: skip
            return None
        stored = self.series(family, values)
        if stored is None:
            return None
        _update(family.type, stored, float(entry.value))
        return family, values


def _update(kind: str, stored: list[float], value: float) -> None:
    if kind == "gauge":
        stored[0] = value
    elif kind == "counter":
        if value >= 0:  # a Prometheus counter never goes down; TorchServe refuses it too
            stored[0] += value
    else:  # histogram: bucket counts, then count and sum
        for i, bound in enumerate(BUCKETS):
            if value <= bound:
                stored[i] += 1
        stored[-2] += 1
        stored[-1] += value
