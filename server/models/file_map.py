"""Whole files mapped read-only into the server, their page tables filled, without holding the
GIL while the kernel fills them; and what a process's mappings of given files hold, read
without parsing all of /proc/<pid>/smaps under the GIL.

The warm tier (warm.py) keeps an evicted model's weights in the page cache by mapping them
with ``MAP_POPULATE``, which reads back any page the kernel reclaimed and maps them all: for a
512 MiB checkpoint, 0.1 s or more. Python's ``mmap.mmap`` holds the GIL for that whole call
(CPython 3.11: measured, a thread mapping three 512 MiB files kept another from running for
0.22 s), and the event loop, though the mapping runs in a thread, waits for the GIL with it:
every request the server had in hand stalled that long. ``mmap(2)`` called through ctypes
releases the GIL for the call, as ctypes does for every foreign call.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
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
        with contextlib.suppress(Exception):  # at exit too, where the process unmaps anyway
            self.close()


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


@dataclass
class Held:
    """What one process's mappings of a file hold (/proc/<pid>/smaps, summed over them)."""

    rss: int = 0  # bytes of the file's pages mapped
    pss: int = 0  # the same, each page divided by the processes that map it
    anonymous: int = 0  # pages of those mappings the process wrote to (its own copies)


def held(pid: int | str, paths: Iterable[str]) -> dict[str, Held]:
    """What process ``pid`` (or ``"self"``) maps of each of ``paths`` (absent: not mapped).

    Read from /proc/<pid>/smaps, looking only at the mappings of those paths: psutil's
    ``memory_maps`` parses every line of it in Python (22 ms of a torch worker's 34 ms, held
    under the GIL, against the event loop), where finding the paths' blocks takes well under
    a millisecond; the kernel's walk of the page tables (the rest) runs with the GIL
    released. OSError (FileNotFoundError: the process is gone) as reading the file raises."""
    with open(f"/proc/{pid}/smaps", "rb") as f:
        text = f.read()
    out: dict[str, Held] = {}
    for path in paths:
        header = b" " + os.fsencode(path) + b"\n"  # a mapping's line ends with its path
        at = text.find(header)
        while at >= 0:
            start = at + len(header)
            end = text.find(b"\nVmFlags:", start)  # the last line of each mapping's block
            block = text[start : end if end >= 0 else len(text)]
            found = out.setdefault(path, Held())
            found.rss += _kib(block, b"Rss:")
            found.pss += _kib(block, b"Pss:")
            found.anonymous += _kib(block, b"Anonymous:")
            at = text.find(header, start)
    return out


def total_pss(pid: int | str) -> int:
    """Process ``pid``'s PSS in bytes (/proc/<pid>/smaps_rollup, Linux 4.14+). OSError when
    it cannot be read."""
    with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
        return _kib(f.read(), b"Pss:")


def _kib(block: bytes, field: bytes) -> int:
    """The value of ``field`` (a line ``Field:   123 kB``) in bytes; 0 when absent."""
    at = block.find(b"\n" + field)
    if at < 0 and block.startswith(field):
        at = -1
    elif at < 0:
        return 0
    nl = block.find(b"\n", at + 1)
    line = block[at + 1 + len(field) : nl if nl >= 0 else len(block)]
    return int(line.split()[0]) * 1024
