"""A ``BaseHandler`` subclass streaming from ``inference``, as TorchServe's LLM examples do (no
model file: initialize is overridden). ``postprocess`` may return a generator per request too:
``{"text": "...", "gen": true}`` streams the words that way instead."""

from ts.handler_utils.utils import send_intermediate_predict_response

from mserve_worker.sdk.base_handler import BaseHandler


class WordStreamer(BaseHandler):
    def initialize(self, context):
        self.context = context
        self.initialized = True

    def preprocess(self, data):
        return [row.get("body") or {} for row in data]

    def inference(self, data, *args, **kwargs):
        if any(spec.get("gen") for spec in data):
            return [iter(spec["text"].split()) for spec in data]
        words = [spec["text"].split() for spec in data]
        for i in range(max(len(w) for w in words) - 1):
            ret = [w[i] if i < len(w) - 1 else "" for w in words]
            live = {j: rid for j, rid in self.context.request_ids.items() if i < len(words[j]) - 1}
            send_intermediate_predict_response(ret, live, "Intermediate", 200, self.context)
        return [w[-1] for w in words]

    def postprocess(self, data):
        return data
