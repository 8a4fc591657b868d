"""The model's own ``archiver`` module."""

SUFFIX = "and its own archiver module"
