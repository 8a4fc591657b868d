"""The JSON schemas of the traffic, canary and shadow bodies and answers (docs/rollouts.md,
docs/shadow.md), for the API description (server/rest/description.py). Their bounds come from
the parsers (server/rollouts/policy.py, shadow_settings.py), so that a client generated from
the description sends what the parsers accept; the parsers stay the one place that checks.
"""

from __future__ import annotations

from typing import Any

from server.rollouts.policy import MAX_KEY_NAME, MAX_SPLIT_VERSIONS, MAX_STEPS
from server.rollouts.shadow_settings import MAX_CONCURRENCY, MAX_QUEUE, MAX_SAMPLES

_VERSION = {"type": "string", "minLength": 1, "description": "a registered version"}
_PERCENT = {"type": "number", "minimum": 0, "maximum": 100}
_KEY = {"type": "string", "minLength": 1, "maxLength": MAX_KEY_NAME}

TRAFFIC_BODY: dict[str, Any] = {
    "type": "object",
    "description": "the split (percent per registered version, adding up to 100) and/or where"
                   " the sticky key is read (a request header, or a top-level field of a JSON"
                   " body); a field left out is cleared",
    "additionalProperties": False,
    "properties": {
        "weights": {"type": "object", "minProperties": 1, "maxProperties": MAX_SPLIT_VERSIONS,
                    "additionalProperties": _PERCENT,
                    "description": 'version -> percent, such as {"1.0": 90, "2.0": 10}'},
        "sticky": {"description": '{"header": name} or {"field": name}', "oneOf": [
            {"type": "object", "required": ["header"], "additionalProperties": False,
             "properties": {"header": _KEY}},
            {"type": "object", "required": ["field"], "additionalProperties": False,
             "properties": {"field": _KEY}},
        ]},
    },
}  # fmt: skip

CANARY_BODY: dict[str, Any] = {
    "type": "object",
    "description": "the canary plan; every field but version has a default (docs/rollouts.md)",
    "required": ["version"],
    "additionalProperties": False,
    "properties": {
        "version": {**_VERSION, "description": "the version rolled out"},
        "baseline": {**_VERSION, "description": "judged against (default: the default version)"},
        "steps": {"type": "array", "minItems": 1, "maxItems": MAX_STEPS,
                  "items": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                            "maximum": 100},
                  "description": "the canary's share per step, rising, ending at 100"},
        "interval_s": {"type": "number", "minimum": 0.1, "maximum": 86400,
                       "description": "seconds each step is held"},
        "window_s": {"type": "number", "minimum": 0.1, "maximum": 3600,
                     "description": "seconds of each judged window"},
        "max_error_ratio": {"type": "number", "minimum": 0, "maximum": 1,
                            "description": "how far the canary's 5xx ratio may pass the"
                                           " baseline's"},
        "max_p99_ratio": {"type": "number", "minimum": 1, "maximum": 1000,
                          "description": "its p99 latency over the baseline's, at most"},
        "p99_floor_ms": {"type": "number", "minimum": 0, "maximum": 3_600_000,
                         "description": "latencies under this are never a breach"},
        "max_p50_ratio": {"type": "number", "minimum": 1, "maximum": 1000,
                          "description": "its median latency over the baseline's, at most"},
        "min_requests": {"type": "integer", "minimum": 1, "maximum": 1_000_000,
                         "description": "answers a window needs to be judged"},
    },
}  # fmt: skip

SHADOW_BODY: dict[str, Any] = {
    "type": "object",
    "description": "the shadow's settings; every field but version has a default"
                   " (docs/shadow.md)",
    "required": ["version"],
    "additionalProperties": False,
    "properties": {
        "version": {**_VERSION, "description": "the version shadowed onto"},
        "source": {**_VERSION, "description": "whose requests (default: the default version)"},
        "share": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 100,
                  "description": "percent of the source's requests copied"},
        "compare": {"type": "object", "description": "how answers are compared"
                    " (server/compare/answers.py: CompareOptions)",
                    "additionalProperties": False, "properties": {
                        "abs_tol": {"type": "number", "minimum": 0},
                        "rel_tol": {"type": "number", "minimum": 0},
                        "top_k": {"type": "integer", "minimum": 0, "maximum": 1000},
                        "nan_equal": {"type": "boolean"},
                        "max_differences": {"type": "integer", "minimum": 0,
                                            "maximum": 1000},
                    }},
        "queue_size": {"type": "integer", "minimum": 0, "maximum": MAX_QUEUE,
                       "description": "pairs waiting for a place; more are dropped"},
        "concurrency": {"type": "integer", "minimum": 0, "maximum": MAX_CONCURRENCY,
                        "description": "shadow requests at once (0: its ready workers)"},
        "timeout_s": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                      "maximum": 3600},
        "samples": {"type": "integer", "minimum": 0, "maximum": MAX_SAMPLES,
                    "description": "differing pairs kept for GET"},
    },
}  # fmt: skip

_OBJECT_OR_NULL = {"type": "object", "nullable": True}

SCHEMAS: dict[str, Any] = {
    "Traffic": {
        "type": "object",
        "description": "a model's traffic: the split set, the split in force, each version's"
                       " share of what was served, the sticky key, the canary, the shadow",
        "required": ["weights", "split", "sticky", "served", "canary", "shadow"],
        "properties": {
            "weights": {"type": "object", "additionalProperties": {"type": "number"}},
            "split": {"type": "object", "additionalProperties": {"type": "number"}},
            "sticky": _OBJECT_OR_NULL,
            "served": {"type": "object"},
            "canary": _OBJECT_OR_NULL,
            "shadow": _OBJECT_OR_NULL,
        },
    },
    "Canary": {
        "type": "object",
        "description": "a canary rollout: its state, step, share and the last window judged",
        "required": ["version", "baseline", "state", "step", "steps", "plan"],
        "properties": {
            "version": {"type": "string"}, "baseline": {"type": "string"},
            "state": {"type": "string"}, "step": {"type": "integer"},
            "steps": {"type": "array", "items": {"type": "number"}},
            "share": {"type": "number", "nullable": True},
            "reason": {"type": "string", "nullable": True},
            "plan": {"type": "object"},
        },
    },
    "Shadow": {
        "type": "object",
        "description": "a shadow: its settings, counts and latencies (GET adds samples, the"
                       " kept differing pairs)",
        "required": ["settings", "counts"],
        "properties": {"settings": {"type": "object"}, "counts": {"type": "object"},
                       "samples": {"type": "array"}},
    },
}  # fmt: skip
