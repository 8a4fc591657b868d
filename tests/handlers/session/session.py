"""A stateful streaming handler on the contract of TorchServe's sequence continuous batching
example (examples/stateful/sequence_continuous_batching), written for TorchServe and unedited:
per sequence, a running total in the worker; per request, ``context.cache`` state and a stopping
criterion.

A request's body is an integer (as text, or ``{"input": n}``), added to its sequence's total:

- even: answered at once with the total;
- odd: streamed, the total once per step for up to ``steps`` more steps (model config
  ``handler: {steps, step_s}``), until the sequence is cancelled or ended;
- ``-1``: cancels the sequence's streams (they end at the next step) and answers ``-1``;
- ``0``: ends the sequence: answers the total and sets the end header;
- a sequence this worker has no total for and no start header: answered with the number and
  ended (its state is elsewhere, or gone).
"""

import json
import time

from ts.torch_handler.base_handler import BaseHandler


class Session(BaseHandler):
    def initialize(self, context):
        self.context = context
        context.cache = {}
        self.totals = {}  # sequence id -> running total
        options = (context.model_yaml_config or {}).get("handler") or {}
        self.steps = int(options.get("steps", 10))
        self.step_s = float(options.get("step_s", 0.2))
        self.initialized = True

    def preprocess(self, data):
        ctx = self.context
        answers = []
        for idx, row in enumerate(data):
            seq = ctx.get_sequence_id(idx)
            ctx.set_response_header(idx, ctx.header_key_sequence_id, seq)
            req = ctx.get_request_id(idx)
            if req in ctx.cache:  # a stream going on: one more step
                time.sleep(self.step_s)
                answers.append(self.totals.get(seq, 0))
                continue
            body = row.get("data") or row.get("body")
            if isinstance(body, (bytes, bytearray)):
                body = body.decode()
            if isinstance(body, dict):
                body = body.get("input")
            n = int(json.loads(body) if isinstance(body, str) else body)
            if ctx.get_request_header(idx, ctx.header_key_sequence_start):
                self.totals[seq] = 0
            flags = ctx.cache.setdefault(seq, {"cancel": False, "end": False, "running": 0})
            flags["running"] += 1
            state = ctx.cache[req] = {"seq": seq, "stream": False, "left": self.steps}
            if n == -1:
                flags["cancel"] = True
                answers.append(-1)
            elif seq not in self.totals:
                flags["end"] = True
                ctx.set_response_header(idx, ctx.header_key_sequence_end, seq)
                answers.append(n)
            else:
                self.totals[seq] += n
                if n == 0:
                    flags["end"] = True
                    ctx.set_response_header(idx, ctx.header_key_sequence_end, seq)
                state["stream"] = n % 2 == 1
                answers.append(self.totals[seq])
        return answers

    def inference(self, answers):
        return answers

    def postprocess(self, answers):
        ctx = self.context
        ctx.stopping_criteria = [self._criterion(r) for r in ctx.request_ids.values()]
        return answers

    def _criterion(self, req):
        def done(_answer):
            cache = self.context.cache
            state = cache[req]
            flags = cache[state["seq"]]
            if state["stream"] and not (flags["cancel"] or flags["end"]) and state["left"]:
                state["left"] -= 1
                return False  # more to come
            del cache[req]
            flags["running"] -= 1
            if not flags["running"]:  # the sequence's last request here: its flags reset
                if flags["end"]:
                    self.totals.pop(state["seq"], None)
                del cache[state["seq"]]
            return True if state["stream"] else None

        return done
