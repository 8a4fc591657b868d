"""Metrics: the metrics port (8082) and every metric behind it.

- :mod:`.server_metrics`: :class:`Metrics` (ours, TorchServe's under its names, the handlers',
  the metric logs) and the ``/metrics`` API.
- :mod:`.model_stats`: what the metrics observe of the models, and each model version's few
  floats on the prediction path.
- :mod:`.handler`: what handlers record through ``context.metrics``, and TorchServe's
  metrics.yaml.
- :mod:`.formats`: TorchServe's metric log line and its Prometheus text, by hand.
- :mod:`.system`: the host's CPU, memory, disk and GPU use.

The package imports nothing of the model supervision above it (server/models/): the models
report to it through the shapes :mod:`.model_stats` describes.
"""
