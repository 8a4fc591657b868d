"""The torch-model-archiver release whose Python API this package reproduces.

Archives record mserve's own version (``archiverVersion: mserve-...``), as the command's do."""

__version__ = "0.12.0"
