"""TorchServe's ``ts.handler_utils`` (streaming helpers)."""
