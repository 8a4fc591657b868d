"""TorchServe's ``ts.metrics``: the names handlers use with ``context.metrics``."""
