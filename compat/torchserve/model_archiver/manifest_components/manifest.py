"""``RuntimeType``: the values ``ModelArchiverConfig.runtime`` and ``--runtime`` take.

The manifest itself is built and written by ``archiver`` (``archiver.manifest.Manifest``)."""

from enum import Enum


class RuntimeType(Enum):
    PYTHON = "python"
    PYTHON3 = "python3"
    LSP = "LSP"
