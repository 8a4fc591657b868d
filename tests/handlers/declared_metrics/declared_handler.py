"""Updates metrics it never defines, as TorchServe's custom_metrics example does: they are
declared in the server's metrics config (model_metrics), which TorchServe's worker reads, so
``get_metric`` finds them."""


def handle(data, context):
    if data is None:
        return None
    metrics = context.metrics
    metrics.get_metric("RequestBatchSize", "counter").add_or_update(
        len(data), [context.model_name, "Model"]
    )
    return [{"ok": True} for _ in data]
