"""What a handler keeps across hot reloads of its code: a per-worker store of loaded objects
(weights, tokenizers, sessions) by key, so that a reload that changes ``preprocess`` does not pay
the weights' load again (docs/hot-reload.md)::

    from mserve_worker.sdk.keep import file_key, keep

    def initialize(self, context):
        path = os.path.join(context.system_properties["model_dir"], "model.pt")
        self.model = keep(("weights", file_key(path)), lambda: torch.load(path))

``keep(key, factory)`` returns the object kept under ``key``, calling ``factory()`` only when
there is none. Put in the key what the object depends on (the file's identity, the device, an
option): a reload whose key changed builds it anew.

What is kept, and for how long: an entry lives while the serving code asked for it. A reload
prepares the new code beside the old: the keys its load asks for are the new code's. When the
reload commits, entries the new code did not ask for while loading are released (ask for what
you keep in ``initialize``); when it fails, entries only the failed load made are released and
the old code keeps its own. The store is the worker's: each worker of a model keeps its own
copy, and a worker that restarts starts empty.

Runs inside a worker: standard library only, Python 3.8+.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["file_digest", "file_key", "forget", "keep"]


class KeepStore:
    """The entries, and which of them the serving code and a reload being prepared asked for."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, Any] = {}
        self._serving: set[Hashable] = set()  # asked for by the code that serves
        self._preparing: set[Hashable] | None = None  # asked for by the code a reload loads
        self._lock = threading.RLock()  # a factory may keep() another key

    def keep(self, key: Hashable, factory: Callable[[], T]) -> T:
        with self._lock:
            asked = self._serving if self._preparing is None else self._preparing
            if key in self._entries:
                asked.add(key)
                return self._entries[key]  # type: ignore[no-any-return]
            value = factory()
            self._entries[key] = value
            asked.add(key)
            return value

    def forget(self, key: Hashable) -> bool:
        with self._lock:
            self._serving.discard(key)
            if self._preparing is not None:
                self._preparing.discard(key)
            return self._entries.pop(key, None) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    # the reload's steps (mserve_worker/reload.py) ----------------------------------------------

    def begin(self) -> None:
        """A reload loads the new code: what it asks for from now on is the new code's."""
        with self._lock:
            self._preparing = set()

    def end(self) -> frozenset[Hashable]:
        """The new code has loaded (or failed to): the keys it asked for. From now on, until the
        reload commits, what is asked for is the serving (old) code's again."""
        with self._lock:
            keys, self._preparing = frozenset(self._preparing or ()), None
            return keys

    def commit(self, keys: frozenset[Hashable]) -> int:
        """The new code, which asked for ``keys``, serves: release the rest; how many."""
        with self._lock:
            dropped = [k for k in self._entries if k not in keys]
            for key in dropped:
                del self._entries[key]
            self._serving = set(keys)
            return len(dropped)

    def abort(self, keys: frozenset[Hashable]) -> int:
        """The new code, which asked for ``keys``, will not serve: release what only it made;
        how many."""
        with self._lock:
            made = [k for k in keys if k not in self._serving and k in self._entries]
            for key in made:
                del self._entries[key]
            return len(made)


# One store per worker process: every handler of the worker and every reload of it share it.
STORE = KeepStore()


def keep(key: Hashable, factory: Callable[[], T]) -> T:
    """The object kept under ``key`` in this worker, made by ``factory()`` if there is none."""
    return STORE.keep(key, factory)


def forget(key: Hashable) -> bool:
    """Release the object kept under ``key`` (True if there was one)."""
    return STORE.forget(key)


def file_key(path: str) -> tuple[str, int, int]:
    """A file's identity without reading it: real path, size and modification time (ns). Cheap
    enough for a weights file of gigabytes at every load; a file rewritten in place changes it."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    return real, stat.st_size, stat.st_mtime_ns


def file_digest(path: str) -> str:
    """The sha256 of a file's bytes (``sha256:<hex>``), read in 1 MiB pieces: a key that holds
    when the file is copied or touched, at the price of reading it at every load."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return "sha256:" + digest.hexdigest()
