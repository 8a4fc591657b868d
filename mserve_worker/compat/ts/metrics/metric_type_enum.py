"""TorchServe's ``ts.metrics.metric_type_enum``: how a metric aggregates."""

import enum


class MetricTypes(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"
