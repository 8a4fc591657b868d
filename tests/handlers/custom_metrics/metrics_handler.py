"""Records custom metrics through ``context.metrics`` the ways TorchServe handlers do: every typed
helper, dimensions as objects with ``.name``/``.value`` (TorchServe's ``Dimension``) and as
pairs, per request (``idx``) and per batch. The body's ``user`` becomes a dimension value, so a
test can invent as many label values as it likes."""

import json
import os


class Dimension:
    """The shape of TorchServe's ``ts.metrics.dimension.Dimension``."""

    def __init__(self, name, value):
        self.name = name
        self.value = value


def handle(data, context):
    metrics = context.metrics
    if data is None:  # loading: TorchServe handlers record metrics in initialize too
        print("custom metrics handler loaded", flush=True)
        metrics.add_counter("ModelLoads", 1, dimensions=[Dimension("Stage", "load")])
        return None
    out = []
    for i, row in enumerate(data):
        body = row.get("body")
        if isinstance(body, (bytes, bytearray)):
            body = json.loads(body)
        body = body if isinstance(body, dict) else {}
        metrics.add_counter(
            "ItemsSeen", 1, idx=i, dimensions=[Dimension("Color", body.get("color", "red"))]
        )
        metrics.add_time("StepTime", 2.5, idx=i, dimensions=[("Stage", "pre")])
        metrics.add_size("PayloadSize", 0.5, idx=i)
        metrics.add_percent("Confidence", 90, idx=i)
        metrics.add_metric("DistanceInKM", 3, idx=i, unit="km")
        metrics.add_time("LatencyHist", 0.3, idx=i)
        # TorchServe 0.8's order, metric type last: a gauge, not add_metric's default counter
        metrics.add_metric("QueueLen", 7, "count", i, None, "gauge")
        if "user" in body:
            metrics.add_counter("PerUser", 1, idx=i, dimensions=[("User", str(body["user"]))])
        out.append({"pid": os.getpid()})
    return out
