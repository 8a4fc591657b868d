from archiver import SUFFIX
from server import GREETING


def handle(data, context):
    return [f"{GREETING} {SUFFIX}" for _ in data or []]
