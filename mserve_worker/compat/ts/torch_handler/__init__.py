"""TorchServe's built-in handlers (``ts.torch_handler.*``)."""
