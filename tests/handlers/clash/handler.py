def handle(data, context):
    return [1 for _ in data or []]
