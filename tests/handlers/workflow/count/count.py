"""A workflow's model node: counts the characters of the bytes it gets; a body of ``boom``
raises (a node that fails)."""


def handle(data, context):
    if data is None:
        return None
    out = []
    for row in data:
        text = bytes(row["body"]).decode("utf-8")
        if text == "boom":
            raise ValueError("count cannot count 'boom'")
        out.append({"chars": len(text), "batch": len(data)})
    return out
