"""Whole files mapped read-only into the server, their page tables filled, without holding the
GIL while the kernel fills them.

The warm tier (warm.py) keeps an evicted model's weights in the page cache by mapping them
with ``MAP_POPULATE``, which reads back any page the kernel reclaimed and maps them all: for a
512 MiB checkpoint, 0.1 s or more. Python's ``mmap.mmap`` holds the GIL for that whole call
(CPython 3.11: measured, a thread mapping three 512 MiB files kept another from running for
0.22 s), and the event loop, though the mapping runs in a thread, waits for the GIL with it:
every request the server had in hand stalled that long. ``mmap(2)`` called through ctypes
releases the GIL for the call, as ctypes does for every foreign call.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from typing import Protocol


class FileMapping(Protocol):
    def close(self) -> None: ...


class _Mapped:
    """A mapping made by :func:`_libc`'s ``mmap``: its address and length, until closed."""

    def __init__(self, address: int, length: int) -> None:
        self.address: int | None = address
        self.length = length

    def close(self) -> None:
        """Unmap (the GIL released too: unmapping 512 MiB takes milliseconds). Idempotent."""
        if self.address is None:
            return
        address, self.address = self.address, None
        if _libc().munmap(ctypes.c_void_p(address), ctypes.c_size_t(self.length)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap: {os.strerror(err)}")

    def __del__(self) -> None:  # as an mmap object does: a mapping forgotten is not leaked
        if self.address is not None:
            _libc().munmap(ctypes.c_void_p(self.address), ctypes.c_size_t(self.length))


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_long,
    ]  # fmt: skip
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


_MAP_FAILED = ctypes.c_void_p(-1).value


def map_file(path: str) -> FileMapping | None:
    """``path`` mapped whole, read-only and shared, every page mapped (read back in if the
    kernel had reclaimed it); None for an empty file. OSError when it cannot be opened or
    mapped. Off Linux, a plain ``mmap`` (no ``MAP_POPULATE`` to ask for)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        if not sys.platform.startswith("linux"):
            return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
        address = _libc().mmap(None, size, mmap.PROT_READ, flags, fd, 0)
        if address is None or address == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap: {os.strerror(err)}", path)
        return _Mapped(address, size)
    finally:
        os.close(fd)
