"""Hot reload's fixture (tests/server/test_hot_reload*.py): "weights" that take a while to load,
kept across reloads of the code (mserve_worker/sdk/keep.py). Each answer says which code
answered (ANSWER), how many times this worker loaded the weights and its pid, so a test sees
that a reload changed the code without loading the weights again or restarting the worker.
Tests copy this folder and edit the copy."""

import json
import os
import time

from mserve_worker.sdk.keep import keep

ANSWER = "v1"
LOAD_S = 0.3  # the weights' load


def _load_weights() -> dict:
    keep("loads", lambda: [0])[0] += 1
    time.sleep(LOAD_S)
    return {"w": 42}


class Handler:
    def initialize(self, context) -> None:
        self.weights = keep("weights", _load_weights)
        self.loads = keep("loads", lambda: [0])

    def handle(self, data, context) -> list:
        out = []
        for row in data:
            body = row.get("body") if isinstance(row, dict) else None
            if isinstance(body, (bytes, bytearray)):
                body = json.loads(body or b"{}")
            if isinstance(body, dict) and body.get("sleep"):
                time.sleep(float(body["sleep"]))
            out.append({"answer": ANSWER, "loads": self.loads[0], "pid": os.getpid()})
        return out
