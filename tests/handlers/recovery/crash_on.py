"""TorchServe's test_auto_recover handler in shape: loads at once and answers every request,
except that a body of 42 sleeps past the response timeout (TorchServe's test) and a body of
"exit" ends the worker's process; the replacement worker loads and serves again."""

import os
import time


class FailingModel:
    def initialize(self, context):
        print("[xxx] Model initialization ... !!")
        self.initialized = True
        print("[xxx] Model initialization ... DONE !!")

    def handle(self, data, context):
        out = []
        for idx, row in enumerate(data):
            body = row.get("body")
            if isinstance(body, (bytes, bytearray)):
                body = body.decode()
            if body in (42, "42"):
                time.sleep(5)
            elif body in ("exit", '"exit"'):
                os._exit(3)
            out.append(f"sample output {idx}")
        return out
