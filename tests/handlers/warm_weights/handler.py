"""BaseHandler's own loading (modelFile + serializedFile), unchanged: the warm tier maps its
state dict. Answers a digest of the output for a seeded input, the worker's pid and whether its
weights were mapped. ``handler: {load_sleep_s: ...}`` in the model config makes each load that
much slower (a model that is dear to reload); ``handler: {write_in_place: true}`` scales its
first layer's weights by 1 in place once loaded (the same values, written: private copies of
those mapped pages); ``handler: {park_sleep_s: ...}`` makes each full garbage collection (what a
worker being parked runs) that much slower, so that a request can arrive while it is parked."""

import gc
import hashlib
import os
import time

import torch
from stack import WIDTH

from mserve_worker.sdk import weights
from mserve_worker.sdk.base_handler import BaseHandler


class Handler(BaseHandler):
    handler_options = ("load_sleep_s", "write_in_place", "park_sleep_s")
    load_sleep_s = 0.0
    write_in_place = False
    park_sleep_s = 0.0

    def initialize(self, context):
        super().initialize(context)
        time.sleep(self.load_sleep_s)
        if self.write_in_place:
            with torch.no_grad():
                next(self.model.parameters()).mul_(1.0)
        if self.park_sleep_s:
            gc.callbacks.append(self._slow_full_collection)

    def _slow_full_collection(self, phase, info):
        if phase == "start" and info.get("generation") == 2:
            time.sleep(self.park_sleep_s)

    def preprocess(self, data):
        seeds = [int((row.get("body") or row.get("data") or {}).get("seed", 0)) for row in data]
        return torch.stack(
            [torch.randn(WIDTH, generator=torch.Generator().manual_seed(s)) for s in seeds]
        )

    def inference(self, data):
        with torch.no_grad():
            return self.model(data)

    def postprocess(self, output):
        return [
            {
                "digest": hashlib.sha256(row.numpy().tobytes()).hexdigest(),
                "pid": os.getpid(),
                "mapped": weights.is_mapped(self.model_pt_path),
                "model_dir": os.path.dirname(self.model_pt_path),
            }
            for row in output
        ]
