"""The built-in image classifier in a worker where ``import captum`` fails as it does in a model
environment without captum (the test environment has it): predictions work, explanations say
what to install."""

import importlib.abc
import sys

from mserve_worker.sdk.image_classifier import ImageClassifier


class HideCaptum(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "captum":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


class NoCaptumClassifier(ImageClassifier):
    def initialize(self, context):
        for name in [m for m in sys.modules if m.split(".")[0] == "captum"]:
            del sys.modules[name]
        sys.meta_path.insert(0, HideCaptum())
        super().initialize(context)
