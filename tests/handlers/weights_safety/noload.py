"""Answers without loading its serialized file: a registration's weights scan is what reads it."""


def handle(data, context):
    if data is None:
        return None
    return [{"ok": True} for _ in data]
