"""A handler whose module takes ten minutes to import: a model that is still loading."""

import time

time.sleep(600)


def handle(data, context):
    return data
