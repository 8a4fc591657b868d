"""A stateful handler written for TorchServe's sequence batching, unedited: it keeps a running
sum per sequence in its worker (keyed by ``context.get_sequence_id(idx)``), starts it afresh on
the sequence start header and echoes the sequence id in the response header, as TorchServe's
examples/stateful handler does.

A request is ``{"add": n}`` (``"sleep"``: seconds to take); the answer says the sum so far, how
many requests of the sequence this worker saw, whether the request started the sequence, and
the worker's pid."""

import json
import os
import time

from ts.context import Context
from ts.torch_handler.base_handler import BaseHandler


class Stateful(BaseHandler):
    def initialize(self, context: Context):
        self.context = context
        self.sums = {}
        self.initialized = True

    def preprocess(self, data):
        rows = []
        for idx, row in enumerate(data):
            sequence_id = self.context.get_sequence_id(idx)
            self.context.set_response_header(idx, self.context.header_key_sequence_id, sequence_id)
            started = bool(
                self.context.get_request_header(idx, self.context.header_key_sequence_start)
            )
            if started or sequence_id not in self.sums:
                self.sums[sequence_id] = [0, 0]
            body = row.get("data") or row.get("body") or {}
            if isinstance(body, (bytes, bytearray)):  # gRPC's input map
                body = json.loads(body)
            rows.append(
                (sequence_id, int(body.get("add", 0)), float(body.get("sleep", 0)), started)
            )
        return rows

    def inference(self, rows):
        time.sleep(max(r[2] for r in rows))
        out = []
        for sequence_id, add, _sleep, started in rows:
            state = self.sums[sequence_id]
            state[0] += add
            state[1] += 1
            out.append({"sum": state[0], "seen": state[1], "start": started, "pid": os.getpid()})
        return out

    def postprocess(self, out):
        return out
