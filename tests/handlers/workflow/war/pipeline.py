"""A workflow's functions (its .war handler), in TorchServe's form: ``pre`` takes the client's
request, ``post`` the answers of the two models that ran in parallel, one field per model."""

import json


def pre(data, context):
    if not data:
        return None
    row = data[0]
    raw = row.get("data") or row.get("body")
    text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else str(raw)
    return [text.strip()]


def post(data, context):
    if not data:
        return None
    row = data[0]
    return [
        {
            "upper": bytes(row["upper"]).decode("utf-8"),
            "count": json.loads(row["count"]),
            "fields": sorted(row),
        }
    ]
