"""Module-function handler: echoes each request's body and records every call it gets."""

CALLS = []


def handle(data, context):
    if data is None:
        CALLS.append(("init", context.model_name))
        return None
    CALLS.append(("batch", len(data)))
    return [row.get("body") for row in data]


def shout(data, context):
    if not data:
        CALLS.append(("shout-init", context.model_name))
        return None
    return [str(row.get("body")).upper() for row in data]
