"""Reports the version of the package its environment installed, and where it runs."""

import sys

import mservetestpkg


def handle(data, context):
    if data is None:
        return None
    return [{"version": mservetestpkg.VERSION, "python": sys.executable} for _ in data]
