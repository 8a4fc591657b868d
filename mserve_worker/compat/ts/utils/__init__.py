"""TorchServe's handler utilities (``ts.utils.*``)."""
