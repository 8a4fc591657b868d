"""Compatibility namespaces: other servers' import names, resolved to mserve's implementations.

This folder (not the package) goes on a worker's ``sys.path`` right after the model's own folder,
so ``import ts.torch_handler.base_handler`` in a handler written for TorchServe finds ours, even
in an environment where the real ``torchserve`` package is installed (its ``ts`` talks to
TorchServe's Java frontend and cannot serve here). docs/handlers.md says which names exist.

When the model's environment has the real ``torchserve`` distribution installed, ours still wins
(this folder is ahead of site-packages); :func:`shadowed_torchserve` names the installed version so
the worker logs that choice once at load.
"""

from __future__ import annotations

import functools
import os
import sys

COMPAT_DIR = os.path.dirname(os.path.abspath(__file__))


def install(after: str | None = None) -> None:
    """Put the compatibility folder on ``sys.path``, right after ``after`` when it is there."""
    if COMPAT_DIR in sys.path:
        return
    index = sys.path.index(after) + 1 if after in sys.path else 0
    sys.path.insert(index, COMPAT_DIR)


@functools.lru_cache(maxsize=None)
def shadowed_torchserve() -> str | None:
    """The version of the ``torchserve`` distribution installed in this environment, if any: its
    ``ts`` package is the one ours hides.

    Remembered: a worker template asks once, while it waits for its first spawn, and the
    workers forked from it inherit the answer. Asking costs a worker ~20 ms otherwise (importing
    ``importlib.metadata`` and scanning every ``sys.path`` folder), on the way to its first
    answer."""
    from importlib import metadata

    try:
        return metadata.version("torchserve")
    except metadata.PackageNotFoundError:
        return None
