"""Served from an environment where a package named torchserve is installed: reports which
``ts`` the handler imported (ours, or the installed one, which marks itself)."""

import ts
from ts.torch_handler.base_handler import BaseHandler


class Which(BaseHandler):
    def initialize(self, context):
        self.initialized = True

    def handle(self, data, context):
        return [
            {"ts": ts.__file__, "installed_ts": hasattr(ts, "INSTALLED_TORCHSERVE")} for _ in data
        ]
