"""A model that takes a fixed time per batch (PACE_S) and echoes each body: a queue that fills
under load, so the tests can see whose requests it serves."""

import time

PACE_S = 0.01


def handle(data, context):
    if data is None:
        return None
    time.sleep(PACE_S)
    return [row.get("body") for row in data]
