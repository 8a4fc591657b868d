"""A TorchServe-style handler that routes on the ``url_path`` request header, as TorchServe's
vLLM handler does for ``/predictions/{m}/{v}/v1/chat/completions``."""


def handle(data, context):
    if data is None:
        return None
    out = []
    for i, row in enumerate(data):
        body = row.get("body")
        if isinstance(body, (bytes, bytearray)):
            body = body.decode("utf-8", "replace")
        out.append({"url_path": context.get_request_header(i, "url_path"), "body": body})
    return out
