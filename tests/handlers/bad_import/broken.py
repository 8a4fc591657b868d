"""A handler whose dependency is not installed: the import fails inside this module."""

import mserve_test_missing_dependency  # noqa: F401


def handle(data, context):
    return data
