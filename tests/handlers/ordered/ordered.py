"""A model that takes PACE_S per batch and answers each request with the number of the batch
it ran in (counted by this worker) and its own body: the order the worker ran them in. A
request whose body is "crash" ends the worker's process instead."""

import json
import os
import time

PACE_S = 0.5
_batches = 0


def handle(data, context):
    global _batches
    if data is None:
        return None
    _batches += 1
    if any(row.get("body") in (b"crash", bytearray(b"crash"), "crash") for row in data):
        os._exit(3)
    time.sleep(PACE_S)
    answers = []
    for row in data:
        body = row.get("body")
        text = body.decode() if isinstance(body, (bytes, bytearray)) else str(body)
        answers.append(json.dumps({"batch": _batches, "body": text}))
    return answers
