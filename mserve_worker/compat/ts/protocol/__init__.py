"""TorchServe's ``ts.protocol`` (only what handlers import from it)."""
