"""JSON Schemas for the custom resources the chart renders, which no offline Kubernetes schema
set holds: prometheus-operator's ServiceMonitor and PodMonitor (monitoring.coreos.com/v1) and
KServe's ServingRuntime and ClusterServingRuntime (serving.kserve.io/v1alpha1).

Written here from the fields those projects document, and only as far as this chart uses them:
each object level we write is closed (``additionalProperties: false``), so a misspelt or moved
field fails; enumerations (KServe's protocol versions) and bounds (a model format's priority) are
checked. Embedded core types (a runtime's containers, a label selector) are checked against the
real Kubernetes schema by the test, not here. What this cannot catch: fields these CRDs gained or
dropped in a version we did not read, and anything the operators' webhooks refuse.
"""

from __future__ import annotations

from typing import Any

_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
        "labels": _LABELS,
        "annotations": _LABELS,
    },
    "additionalProperties": False,
}
_SELECTOR = {
    "type": "object",
    "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}},
    "additionalProperties": False,
}
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_ENDPOINT = {
    "type": "object",
    "properties": {
        "port": {"type": "string"},
        "targetPort": {"type": ["string", "integer"]},
        "path": {"type": "string", "pattern": "^/"},
        "scheme": {"enum": ["http", "https"]},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
        "bearerTokenSecret": {"type": "object"},
        "authorization": {"type": "object"},
        "relabelings": {"type": "array"},
        "metricRelabelings": {"type": "array"},
    },
    "additionalProperties": False,
}


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        "additionalProperties": False,
    }


def _monitor(kind: str, endpoints: str) -> dict[str, Any]:
    """ServiceMonitor and PodMonitor: the same spec but for the name of the endpoints list."""
    return _resource("monitoring.coreos.com/v1", kind, {
        "type": "object",
        "required": ["selector", endpoints],
        "properties": {
            "selector": _SELECTOR,
            "namespaceSelector": {"type": "object"},
            "jobLabel": {"type": "string"},
            endpoints: {"type": "array", "minItems": 1, "items": _ENDPOINT},
        },
        "additionalProperties": False,
    })  # fmt: skip


SERVICE_MONITOR = _monitor("ServiceMonitor", "endpoints")
POD_MONITOR = _monitor("PodMonitor", "podMetricsEndpoints")

_RUNTIME_SPEC = {
    "type": "object",
    "required": ["supportedModelFormats", "containers"],
    "properties": {
        "annotations": _LABELS,
        "labels": _LABELS,
        "supportedModelFormats": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "version": {"type": "string"},
                    "autoSelect": {"type": "boolean"},
                    "priority": {"type": "integer", "minimum": 1},
                },
                # KServe refuses a priority on a format that is not auto-selected
                "dependentRequired": {"priority": ["autoSelect"]},
                "additionalProperties": False,
            },
        },
        "protocolVersions": {
            "type": "array",
            "items": {"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]},
            "uniqueItems": True,
        },
        "multiModel": {"type": "boolean"},
        "disabled": {"type": "boolean"},
        "containers": {"type": "array", "minItems": 1},  # core Containers: checked by the test
        "volumes": {"type": "array"},
        "nodeSelector": _LABELS,
        "tolerations": {"type": "array"},
        "affinity": {"type": "object"},
        "imagePullSecrets": {"type": "array"},
    },
    "additionalProperties": False,
}

SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR,
    ("serving.kserve.io/v1alpha1", "ServingRuntime"):
        _resource("serving.kserve.io/v1alpha1", "ServingRuntime", _RUNTIME_SPEC),
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"):
        _resource("serving.kserve.io/v1alpha1", "ClusterServingRuntime", _RUNTIME_SPEC),
}  # fmt: skip
