"""A workflow's model node: upper-cases the bytes it gets ("body": the previous node's answer)."""


def handle(data, context):
    if data is None:
        return None
    return [bytes(row["body"]).decode("utf-8").upper() for row in data]
