"""TorchServe-style module function. With ``kserveEnvelope: true`` (echo_config.yaml) it answers
a v2 request's decoded inputs as its outputs, so every datatype goes out as it came in (the body's
parameter ``fail`` makes it raise, ``rename`` answers one output under another name). Without it,
it reports what it got, as any TorchServe handler would see it."""


def handle(data, context):
    if data is None:
        return None
    out = []
    for row in data:
        body = row.get("body")
        if context.protocol == "v2":
            params = row.get("parameters") or {}
            if params.get("fail"):
                raise RuntimeError("asked to fail")
            if params.get("rename"):
                body = {params["rename"]: next(iter(body.values()))}
            out.append(body)
            continue
        shown = body if isinstance(body, (dict, list, str)) else f"{len(body)} bytes"
        out.append(
            {
                "protocol": context.protocol,
                "operation": context.operation,
                "type": type(body).__name__,
                "body": shown,
            }
        )
    return out
