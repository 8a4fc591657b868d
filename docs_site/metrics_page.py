"""docs/reference/metrics.md, generated from the metrics' definitions in server/metrics/: every
``mserve_*`` metric the code defines (prometheus_client's Counter, Gauge, Histogram and the
families its collector yields), read from the source with their help text and labels, and
TorchServe's metrics from the tables the code writes them from."""

from __future__ import annotations

import ast
import inspect
from typing import Any

from server.metrics import server_metrics, system
from server.metrics.server_metrics import LEGACY_PROMETHEUS, WORKER_STATES

_KINDS = {
    "Counter": "counter",
    "CounterMetricFamily": "counter",
    "Gauge": "gauge",
    "GaugeMetricFamily": "gauge",
    "Histogram": "histogram",
    "HistogramMetricFamily": "histogram",
    "_histogram": "histogram",
}


def _literal(node: ast.AST | None, names: dict[str, Any]) -> Any:
    if node is None:
        return None
    if isinstance(node, ast.Name):
        return names.get(node.id)
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _labels_of(call: ast.Call, names: dict[str, Any]) -> tuple[str, ...]:
    for kw in call.keywords:
        if kw.arg in ("labels", "labelnames"):
            return tuple(_literal(kw.value, names) or ())
    if len(call.args) >= 3 and not isinstance(call.args[2], ast.Name | ast.Attribute):
        return tuple(_literal(call.args[2], names) or ())
    return ()


def mserve_metrics() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """name -> (kind, help, labels) for every mserve_* metric defined in server_metrics.py."""
    tree = ast.parse(inspect.getsource(server_metrics))
    names: dict[str, Any] = {}  # simple list assignments (labels = [...]) the calls name
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and isinstance(node.value, ast.List | ast.Tuple):
                value = _literal(node.value, {})
                if value is not None:
                    names[target.id] = value
    found: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if called not in _KINDS or not node.args:
            continue
        name = _literal(node.args[0], {})
        if not isinstance(name, str) or not name.startswith("mserve_"):
            continue
        doc = _literal(node.args[1], {}) if len(node.args) > 1 else ""
        labels = ("model",) if called == "_histogram" else _labels_of(node, names)
        previous = found.get(name)
        if previous is None or (doc and not previous[1]) or len(labels) > len(previous[2]):
            found[name] = (_KINDS[called], doc or (previous[1] if previous else ""), labels)
    return found


def render() -> str:
    out = [
        "# Metrics",
        "",
        "Generated at build time from the metrics' definitions in `server/metrics/`, so every",
        "metric the code defines is here with its labels. The metrics port (8082) serves them",
        "at `GET /metrics` in Prometheus's text format; see",
        "[the metrics and logs guide](../metrics-and-logs.md) for the modes and the log files.",
        "",
        "## mserve's own metrics",
        "",
        "A counter's samples carry the `_total` suffix in the exposition",
        "(`mserve_requests_total`).",
        f"`mserve_workers`' `state` is one of {', '.join(f'`{s}`' for s in WORKER_STATES)}.",
        "",
        "| Metric | Type | Labels | Meaning |",
        "|---|---|---|---|",
    ]
    for name, (kind, doc, labels) in sorted(mserve_metrics().items()):
        shown = ", ".join(f"`{label}`" for label in labels) or "—"
        out.append(f"| `{name}` | {kind} | {shown} | {doc} |")
    out += [
        "",
        "## TorchServe's metrics",
        "",
        "Under TorchServe's names, types and labels, so its dashboards and queries keep working.",
        "`uuid` is present in mserve's layout only (TorchServe 0.7's label beside 0.8's).",
        "",
        "| Metric | Type | Unit | Labels |",
        "|---|---|---|---|",
    ]
    units = ("Count", "Microseconds", "Microseconds")
    for name, unit in zip(LEGACY_PROMETHEUS, units, strict=True):
        out.append(f"| `{name}` | counter | {unit} | `uuid`, `model_name`, `model_version`,"
                   " `hostname` |")  # fmt: skip
    for name in ("Requests2XX", "Requests4XX", "Requests5XX"):
        out.append(f"| `{name}` | counter | Count | `Level`, `Hostname` |")
    out.append("| `QueueTime` | gauge | Milliseconds | `Level`, `Hostname` |")
    out.append("| `WorkerThreadTime` | gauge | Milliseconds | `Level`, `Hostname` |")
    out.append("| `WorkerLoadTime` | gauge | Milliseconds | `WorkerName`, `Level`, `Hostname` |")
    for name, unit, labels in system.FAMILIES:
        shown = ", ".join(f"`{label}`" for label in (*labels, "Hostname"))
        out.append(f"| `{name}` | gauge | {unit} | {shown} |")
    out += [
        "",
        "Handler metrics (`context.metrics`, `metrics_config`'s `model_metrics`, and",
        "TorchServe's default `HandlerTime` and `PredictionTime`) are added by the models.",
        "",
    ]
    return "\n".join(out)
