"""A TorchServe-style module function as KServe's TorchServe examples write them: one output per
row of ``data``. Each output says what the row was and how many rows the call got, so a test sees
how the server's envelope split the requests. An instance ``"bad"`` answers that row with 422 (a
per-instance error); ``"short"`` makes the call return one output too few."""


def handle(data, context):
    if data is None:
        return None
    rows = [
        row.get("body", row) if isinstance(row, dict) and "body" in row else row for row in data
    ]
    out = []
    for idx, row in enumerate(rows):
        if row == "bad":
            context.set_response_status(422, "bad instance", idx)
            out.append({"message": f"instance {idx} is bad"})
            continue
        out.append({"row": row, "rows": len(data), "explain": context.operation == "explain"})
    if "short" in rows:
        out.pop()
    return out


def as_given(data, context):
    """Answers each row exactly as the handler got it."""
    return None if data is None else list(data)
