"""A handler class in TorchServe's style (initialize keeps the context) that streams through the
deprecated import path ``ts.protocol.otf_message_handler``."""

from ts.protocol.otf_message_handler import send_intermediate_predict_response


class StreamingHandler:
    def __init__(self):
        self.context = None
        self.initialized = False

    def initialize(self, context):
        self.context = context
        self.initialized = True

    def handle(self, data, context):
        words = [str((row.get("body") or {}).get("text", "")).split() for row in data]
        for i in range(max(len(w) for w in words)):
            ret = [w[i] + " " if i < len(w) else "" for w in words]
            live = {j: rid for j, rid in self.context.request_ids.items() if i < len(words[j])}
            send_intermediate_predict_response(ret, live, "Intermediate", 200, self.context)
        return ["<eos>" for _ in data]
