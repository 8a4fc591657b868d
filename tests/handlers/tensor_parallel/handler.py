"""TorchServe's tensor-parallel test handler (test/pytest/test_parallelism.py), plus a probe: a
request whose body is ``"ranks"`` answers what every rank sees (gathered across the group)."""

import json
import os

import torch
from ts.handler_utils.utils import send_intermediate_predict_response
from ts.torch_handler.base_handler import BaseHandler

_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES")  # fmt: skip


class FooHandler(BaseHandler):
    def initialize(self, ctx):
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")
        torch.set_default_device("cpu")
        self.context = ctx
        super().initialize(ctx)

    def handle(self, data, context):
        body = data[0].get("body")
        if body in (b"ranks", "ranks"):  # every rank takes part in the gather
            mine = {k: os.environ.get(k) for k in _ENV}
            mine.update(pid=os.getpid(), threads=torch.get_num_threads())
            seen = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(seen, mine)
            return [json.dumps(seen)]
        return super().handle(data, context)

    def preprocess(self, data):
        send_intermediate_predict_response(
            ["0"], self.context.request_ids, "Intermediate Prediction success", 200, self.context
        )
        return torch.as_tensor(int(data[0].get("body").decode("utf-8")), device=self.device)

    def postprocess(self, x):
        return [x.item()]
