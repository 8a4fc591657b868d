"""A handler written for TorchServe, unedited: module-level ``ts.*`` imports, a BaseHandler
subclass, PredictionException for bad input, custom metrics with Dimension and MetricTypes,
@timed steps. It reports where ``ts`` came from, so tests can see whose namespace ran."""

import json

import torch
import ts
from ts.context import Context
from ts.handler_utils.timer import timed
from ts.metrics.dimension import Dimension
from ts.metrics.metric_type_enum import MetricTypes
from ts.torch_handler.base_handler import BaseHandler
from ts.utils.util import PredictionException, map_class_to_label


class LinearScores(BaseHandler):
    def initialize(self, context):
        super().initialize(context)
        self.calls = context.metrics.add_metric_to_cache(
            metric_name="LinearCalls",
            unit="count",
            dimension_names=["ModelName"],
            metric_type=MetricTypes.COUNTER,
        )

    @timed
    def preprocess(self, data):
        rows = []
        for row in data:
            body = row.get("data") or row.get("body")
            if isinstance(body, (bytes, bytearray)):
                body = json.loads(body)
            if "fail" in body:
                raise PredictionException(body["fail"], body.get("code", 500))
            rows.append(body["x"])
        return torch.tensor(rows, dtype=torch.float32)

    @timed
    def postprocess(self, data):
        labels = map_class_to_label(torch.softmax(data, dim=1).tolist(), self.mapping)
        metrics = self.context.metrics
        metrics.add_metric(
            "LinearRows",
            len(labels),
            "count",
            None,
            [Dimension("Kind", "rows")],
            MetricTypes.COUNTER,
        )
        metrics.add_time("LinearPost", 1.5, None, "ms", [Dimension("Step", "post")])
        self.calls.add_or_update(1, [self.context.model_name], self.context.get_request_id(0))
        return [
            {
                "labels": label,
                "ts": ts.__file__,
                "context": isinstance(self.context, Context),
                "profile": self.model_yaml_config.get("handler", {}).get("profile", False),
                "device": str(self.get_device()),
                "batch": len(labels),
            }
            for label in labels
        ]
