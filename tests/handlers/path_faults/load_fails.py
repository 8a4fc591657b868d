"""A handler class whose initialize fails the way a missing weights file does: the error names
the file by its absolute path inside the model folder."""

import os


class WeightsHandler:
    def initialize(self, context):
        path = os.path.join(context.system_properties["model_dir"], "weights.bin")
        with open(path, "rb") as f:  # not in the archive: FileNotFoundError with the full path
            self.weights = f.read()

    def handle(self, data, context):
        return [None for _ in data]
