"""Prints when it loads and for each batch, as handlers do: TorchServe's console shows a
worker's output among the server's lines. Echoes each body."""


def handle(data, context):
    if data is None:
        print(f"printer handler loaded as {context.model_name}", flush=True)
        return None
    print(f"printer got {len(data)} request(s)", flush=True)
    return [row.get("body") for row in data]
