"""Loads unless the file its model config's ``fail_if`` names exists: a test makes the loads of
new workers fail while the workers already loaded serve on. Answers each request with its pid."""

import os


class Gated:
    def initialize(self, context):
        marker = context.model_yaml_config.get("fail_if")
        if marker and os.path.exists(marker):
            raise RuntimeError(f"{marker} exists")

    def handle(self, data, context):
        return [{"pid": os.getpid()} for _ in data]
