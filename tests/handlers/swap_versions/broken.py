"""A version that cannot load: its handler fails at its first call (initialisation)."""


def handle(data, context):
    if data is None:
        raise RuntimeError("this version cannot load its weights")
    return data
