"""A toy generator written for TorchServe's continuous batching, unedited: a BaseHandler
subclass that emits one token per call for each request, keeps each request's state in
``context.cache`` (keyed by request id) and sets ``context.stopping_criteria``.

A request is ``{"name": ..., "tokens": n}``; each step answers one JSON line
``{"token": "<name>:<i>", "batch": [names of the requests in this call]}``, so tests see who
joined and who left, and ``"cache"``: the names whose state ``context.cache`` holds. ``{"fail_at": k}`` sets a 500 for that request alone
at its step k; ``{"raise_at": k}`` makes the whole call raise at that step; ``{"sleep": s}``
makes each step take that long (the default is 0.05 s); ``{"intermediate": true}`` also sends
``{"partial": "<name>:<i>"}`` with ``send_intermediate_predict_response`` before each token."""

import json
import time

from ts.handler_utils.utils import send_intermediate_predict_response
from ts.torch_handler.base_handler import BaseHandler


class Generator(BaseHandler):
    def initialize(self, context):
        self.context = context
        context.cache = {}
        self.initialized = True

    def preprocess(self, data):
        ids = []
        for idx, row in enumerate(data):
            req_id = self.context.get_request_id(idx)
            if req_id not in self.context.cache:  # a new request: its prompt is here
                body = row.get("body") or row.get("data") or {}
                if isinstance(body, (bytes, bytearray)):  # gRPC's input map
                    body = json.loads(body)
                self.context.cache[req_id] = {
                    "name": body.get("name", req_id),
                    "left": int(body.get("tokens", 3)),
                    "step": 0,
                    "fail_at": body.get("fail_at"),
                    "raise_at": body.get("raise_at"),
                    "sleep": float(body.get("sleep", 0.05)),
                    "intermediate": bool(body.get("intermediate")),
                    "stop": self._stopping_criteria(req_id),
                }
            ids.append(req_id)
        return ids

    def inference(self, ids):
        time.sleep(max(self.context.cache[r]["sleep"] for r in ids))
        names = [self.context.cache[r]["name"] for r in ids]
        out = []
        for idx, req_id in enumerate(ids):
            state = self.context.cache[req_id]
            if state["raise_at"] == state["step"]:
                raise RuntimeError(f"boom in {state['name']}")
            if state["fail_at"] == state["step"]:
                self.context.set_response_status(500, "token failed", idx)
                state["left"] = 0
                out.append(f"{state['name']} failed")
                continue
            token = f"{state['name']}:{state['step']}"
            if state["intermediate"]:
                partial = [None] * len(ids)
                partial[idx] = json.dumps({"partial": token}) + "\n"
                send_intermediate_predict_response(
                    partial, {idx: req_id}, "Intermediate Prediction success", 200, self.context
                )
            held = sorted(v["name"] for v in self.context.cache.values())
            out.append(json.dumps({"token": token, "batch": names, "cache": held}) + "\n")
            state["step"] += 1
            state["left"] -= 1
        return out

    def postprocess(self, out):
        self.context.stopping_criteria = [
            self.context.cache[r]["stop"] for r in self.context.request_ids.values()
        ]
        return out

    def _stopping_criteria(self, req_id):
        cache = self.context.cache

        class StoppingCriteria:
            def __call__(self, res):
                if cache[req_id]["left"] <= 0:
                    del cache[req_id]
                    return True
                return False

        return StoppingCriteria()
