"""Reports each request's fields as the handler got them: per key, the value's type and the
value (bytes as latin-1 text, so any byte survives JSON), and the Content-Type header."""

import json


def _shown(value):
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("latin-1")
    return value


def handle(data, context):
    if data is None:
        return None
    return [
        json.dumps(
            {
                "fields": {k: [type(v).__name__, _shown(v)] for k, v in row.items()},
                "content_type": context.get_request_header(i, "Content-Type"),
            }
        )
        for i, row in enumerate(data)
    ]
