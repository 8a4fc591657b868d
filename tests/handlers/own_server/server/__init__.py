"""The model's own ``server`` package: TorchServe never reserved the name, neither do we."""

GREETING = "from the model's own server package"
