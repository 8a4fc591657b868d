"""The metrics calls of TorchServe's ``examples/custom_metrics`` handler, without its model:
metrics defined with ``add_metric_to_cache`` and updated through the object or ``get_metric``
(no default dimensions), ``add_metric``/``add_size``/``add_time``/``add_counter``/
``add_percent`` (``ModelName`` and ``Level`` added), ``InitializeCallCount`` at load, and two
metrics (``HandlerMethodTime``, ``ExamplePercentMetric``) that only auto-detection keeps."""

import time

from ts.metrics.dimension import Dimension
from ts.metrics.metric_type_enum import MetricTypes


class CustomMetricsHandler:
    def initialize(self, context):
        metrics = context.metrics
        self.inf_request_count = metrics.add_metric_to_cache(
            metric_name="InferenceRequestCount",
            unit="count",
            dimension_names=[],
            metric_type=MetricTypes.COUNTER,
        )
        metrics.add_metric_to_cache(
            metric_name="PreprocessCallCount",
            unit="count",
            dimension_names=["ModelName"],
            metric_type=MetricTypes.COUNTER,
        )
        # TorchServe's backend finds RequestBatchSize in metrics.yaml; mserve's worker does not
        # read that file, so the handler defines it
        metrics.add_metric_to_cache(
            metric_name="RequestBatchSize",
            unit="count",
            dimension_names=["ModelName"],
            metric_type=MetricTypes.GAUGE,
        )
        metrics.add_metric(
            name="InitializeCallCount", value=1, unit="count", metric_type=MetricTypes.COUNTER
        )
        self.initialized = True

    def handle(self, data, context):
        metrics = context.metrics
        start = time.time()
        self.inf_request_count.add_or_update(value=1, dimension_values=[])
        metrics.get_metric(
            metric_name="PreprocessCallCount", metric_type=MetricTypes.COUNTER
        ).add_or_update(value=1, dimension_values=[context.model_name])
        metrics.get_metric(
            metric_name="RequestBatchSize", metric_type=MetricTypes.GAUGE
        ).add_or_update(value=len(data), dimension_values=[context.model_name])
        body = data[0].get("body") or b""
        metrics.add_size(name="SizeOfImage", value=len(body) / 1024, idx=None, unit="kB")
        metrics.add_time(
            name="HandlerMethodTime",
            value=(time.time() - start) * 1000,
            idx=None,
            unit="ms",
            dimensions=[Dimension(name="MethodName", value="preprocess")],
            metric_type=MetricTypes.GAUGE,
        )
        metrics.add_counter(name="PostprocessCallCount", value=1, idx=None, dimensions=[])
        metrics.add_percent(
            name="ExamplePercentMetric",
            value=50,
            idx=None,
            dimensions=[],
            metric_type=MetricTypes.HISTOGRAM,
        )
        return [len(row.get("body") or b"") for row in data]
