"""The JSON schemas of the tenants paths' bodies and answers (docs/tenants.md,
server/rest/tenants.py), for the API description (server/rest/description.py). The quota fields
and the name's pattern come from the tenants file's parser (server/tenants/file.py), which stays
the one place that checks them.
"""

from __future__ import annotations

from typing import Any

from server.tenants.file import NAME, QUOTA_FIELDS

_POSITIVE = {"type": "number", "exclusiveMinimum": True, "minimum": 0}
QUOTA: dict[str, Any] = {
    "type": "object",
    "description": "requests_per_second (a token bucket holding up to burst), in_flight",
    "additionalProperties": False,
    "properties": {
        field: {"type": "integer", "minimum": 1} if field == "in_flight" else _POSITIVE
        for field in QUOTA_FIELDS
    },
}
_FIELDS: dict[str, Any] = {
    "weight": {**_POSITIVE, "nullable": True,
               "description": "its share of a model's queue under contention (null: 1)"},
    "quota": {**QUOTA, "nullable": True, "description": "over all its models (null: none)"},
    "models": {"type": "object", "nullable": True, "additionalProperties": QUOTA,
               "description": "registered model -> its quota for that model (null: none)"},
}  # fmt: skip

NEW_TENANT_BODY: dict[str, Any] = {
    "type": "object",
    "description": "the new tenant: its name, and optionally its weight and quotas; the server"
                   " makes its first key",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": NAME.pattern,
                 "description": "its label in logs and metrics"},
        **_FIELDS,
    },
}  # fmt: skip

TENANT_BODY: dict[str, Any] = {
    "type": "object",
    "description": "the fields to change; one left out stays, one sent as null is removed",
    "additionalProperties": False,
    "properties": _FIELDS,
}

_SUMMARY_FIELDS = {
    "weight": {"type": "number"},
    "keys": {"type": "integer", "description": "how many keys it has"},
    "quota": {"type": "object"},
    "models": {"type": "object"},
}
_LIVE = {
    "in_flight": {"type": "integer", "nullable": True,
                  "description": "its requests queued or running (null: no in_flight quota)"},
    "bucket_tokens": {"type": "number", "nullable": True,
                      "description": "requests its bucket lets in now (null: no rate quota)"},
    "generated_tokens_left": {"type": "number", "nullable": True,
                              "description": "generated tokens its token bucket holds now,"
                                             " below 0 a debt (null: no token quota)"},
}  # fmt: skip

SCHEMAS: dict[str, Any] = {
    "Tenants": {
        "type": "object",
        "description": "the tenants in force and the file they come from",
        "required": ["file", "tenants"],
        "properties": {
            "file": {"type": "string"},
            "tenants": {"type": "array", "items": {
                "type": "object", "required": ["name", *_SUMMARY_FIELDS],
                "properties": {"name": {"type": "string"}, **_SUMMARY_FIELDS},
            }},
        },
    },
    "TenantSummary": {
        "type": "object",
        "description": "a tenant in force after the change",
        "required": list(_SUMMARY_FIELDS),
        "properties": _SUMMARY_FIELDS,
    },
    "Tenant": {
        "type": "object",
        "description": "a tenant in force: its keys' ids (never a key), quotas and live usage",
        "required": ["name", "weight", "keys", "quota", "models", "usage"],
        "properties": {
            "name": {"type": "string"},
            "weight": {"type": "number"},
            "keys": {"type": "array", "items": {"type": "string"},
                     "description": "ids: sha256: and the first 12 hex digits of each hash"},
            "quota": {"type": "object"},
            "models": {"type": "object"},
            "usage": {"type": "object", "required": ["served", "refused", *_LIVE, "models"],
                      "properties": {
                "served": {"type": "object", "additionalProperties": {"type": "integer"},
                           "description": "model -> requests taken to a worker"},
                "refused": {"type": "object", "additionalProperties": {"type": "integer"},
                            "description": "model -> requests over quota (429)"},
                **_LIVE,
                "models": {"type": "object", "additionalProperties": {
                    "type": "object", "properties": _LIVE}},
            }},
        },
    },
    "TenantKey": {
        "type": "object",
        "description": "a key made by the server: shown this once, only its hash is kept",
        "required": ["name", "key", "id"],
        "properties": {
            "name": {"type": "string"}, "key": {"type": "string"},
            "id": {"type": "string", "description": "what DELETE .../keys/{key_id} takes"},
            **_SUMMARY_FIELDS,
        },
    },
    "TenantRemoved": {
        "type": "object",
        "description": "the tenant removed, or the key revoked and the keys left",
        "required": ["name"],
        "properties": {"name": {"type": "string"}, "removed": {"type": "boolean"},
                       "revoked": {"type": "string"}, "keys": {"type": "integer"}},
    },
}  # fmt: skip
