"""Locks between processes, one way: the kernel's ``flock(2)`` on a file.

Two users: the run dir's lock, held for a server's whole life so that a second server on the same
run dir is refused and ``mserve --status``/``--stop`` can tell a live server from a dead one; and
the lock around building (or pruning) one model environment, which servers sharing an
environment folder take in turn. The kernel drops a flock when its holder dies, ``kill -9``
included, so nothing is ever left locked by a crash.

Why not the ``filelock`` package: on this Linux-only server it would call the same ``flock``, and
its 4.x import costs 60-115 ms, paid by every ``mserve --status`` (this module costs nothing).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path


def try_hold(path: Path) -> int | None:
    """The lock on ``path`` (created if missing) for as long as the returned descriptor stays
    open, or None when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def held_elsewhere(path: Path) -> bool:
    """Whether a process holds the lock on ``path`` now (a missing file: nobody). Only reads
    the file, so a user who may not write it can still ask."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we may have taken
    return False


@contextlib.contextmanager
def exclusive(path: Path, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the lock on ``path`` (created if missing) inside the block, waiting for it as long
    as another process holds it; ``waiting`` is called first when it has to wait (to say so:
    a build elsewhere can take minutes). Blocking: run it in a thread."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
