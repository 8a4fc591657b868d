"""A TorchServe-style streaming handler, unedited for the OpenAI API: it reads its prompt from
the body as text and sends each word back with send_intermediate_predict_response, the last one
as its result. Its model config says ``generative: {input: text}`` (docs/generative.md): the
server sends it the prompt alone and counts each piece as one token."""

from ts.handler_utils.utils import send_intermediate_predict_response


class Reverser:
    def initialize(self, context):
        self.context = context

    def handle(self, data, context):
        words = []
        for row in data:
            body = row.get("body") or row.get("data")
            if isinstance(body, (bytes, bytearray)):
                body = body.decode()
            words.append(list(reversed(body.split())))
        for i in range(max(len(w) for w in words) - 1):
            ret = [w[i] + " " if i < len(w) - 1 else "" for w in words]
            live = {j: rid for j, rid in context.request_ids.items() if i < len(words[j]) - 1}
            send_intermediate_predict_response(ret, live, "Intermediate", 200, context)
        return [w[-1] for w in words]
