"""The names TorchServe's tests import from ``model_archiver.manifest_components``."""
