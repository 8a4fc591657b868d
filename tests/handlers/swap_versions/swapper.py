"""Answers which version of the model and which worker served each request (in-place swap
tests): ``{"sleep": s}`` holds the batch ``s`` seconds first, ``{"hold": name}`` until a file
of that name is in its scratch folder (its TMPDIR: the sandbox lets it see that), at most a
minute."""

import os
import time


def handle(data, context):
    if data is None:
        return None
    for row in data:
        body = row.get("body")
        if isinstance(body, dict) and body.get("sleep"):
            time.sleep(float(body["sleep"]))
        if isinstance(body, dict) and body.get("hold"):
            path = os.path.join(os.environ.get("TMPDIR", "/tmp"), body["hold"])
            deadline = time.monotonic() + 60
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.02)
    version = context.manifest["model"]["modelVersion"]
    return [{"version": version, "pid": os.getpid()} for _ in data]
