"""TorchServe's ``ts`` package as handlers import it, served by mserve's own implementations."""
