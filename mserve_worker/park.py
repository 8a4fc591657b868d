"""A parked worker: an evicted model's idle worker kept alive without its weights' pages.

With the warm tier on, an evicted model's weights stay in the page cache (the server maps
them). Waking it still costs a worker's start: a fork from the template, INIT, the handler's
import and load, the module's build (0.1 s on an idle machine for 512 MiB, 0.3 s and more under
load). A parked worker skips all of it: when its model is evicted the server sends ``park``,
and this worker drops its page-table entries for the mapped checkpoints (``MADV_DONTNEED`` on
each file mapping: the pages stay in the page cache, the process no longer maps them, so its
PSS is its own heap only); on ``wake`` it maps them again (one read per page, each fault mapping
the cached pages around it) and serves its next batch with the handler it already built.

Refused (the server then stops the worker as before) where dropping the pages would lose
something: a mapping the handler wrote to (its pages are private copies now, not the file's:
dropped, they would read back the file's bytes) or a platform without ``madvise``.

Runs inside a worker, in the model's environment: standard library only, Python 3.8.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import sys
import time
from typing import Any

from .park_frames import PARK, Parked

_MADV_DONTNEED = 4  # linux/mman.h
_ranges: list[tuple[int, int]] = []  # (start, end) of the mappings dropped by the last park
_libc: Any = None


def supported() -> bool:
    """Whether this platform can park a worker (Linux: ``/proc/self/smaps`` and ``madvise``)."""
    return sys.platform.startswith("linux") and os.path.exists("/proc/self/smaps")


def step(park_id: int, which: str, files: list[str]) -> Parked:
    """Run one step of a PARK frame on the mappings of ``files`` (real paths); never raises:
    a failure is the answer's ``error``."""
    started = time.perf_counter()
    try:
        done = _park(files) if which == PARK else _wake()
    except (OSError, ValueError) as exc:
        return Parked(park_id, which, False, error=f"cannot {which}: {exc}")
    if isinstance(done, str):
        return Parked(park_id, which, False, error=done)
    return Parked(park_id, which, True, bytes=done, seconds=time.perf_counter() - started)


def _park(files: list[str]) -> int | str:
    """Drop this process's pages of the mappings of ``files``: the bytes they held, or why
    they cannot be dropped."""
    global _ranges
    mappings = _mappings(set(files))
    if not mappings:
        return "none of the model's mapped weights is mapped in this worker any more"
    written = sum(anon for _s, _e, _rss, anon in mappings)
    if written:
        return (
            f"the handler wrote to its mapped weights ({written // 1024} KiB of private copies):"
            " dropping their pages would lose those changes"
        )
    libc = _c_library()
    for start, end, _rss, _anon in mappings:
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED):
            err = ctypes.get_errno()
            return f"madvise(MADV_DONTNEED) failed: {os.strerror(err)}"
    _ranges = [(start, end) for start, end, _rss, _anon in mappings]
    gc.collect()
    trim = getattr(libc, "malloc_trim", None)  # glibc: the heap's free pages back to the kernel
    if trim is not None:
        trim(0)
    return sum(rss for _s, _e, rss, _anon in mappings)


def _wake() -> int:
    """Map the parked pages again: one read per page (what the load's populate does)."""
    mapped = 0
    for start, end in _ranges:
        view = memoryview((ctypes.c_char * (end - start)).from_address(start))
        bytes(view[:: mmap.PAGESIZE])  # copies a byte of each page: a fault per folio
        mapped += end - start
    return mapped


def _mappings(files: set[str]) -> list[tuple[int, int, int, int]]:
    """(start, end, resident bytes, private-copy bytes) of each mapping of ``files``."""
    out: list[tuple[int, int, int, int]] = []
    current: list[int] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):  # a mapping's first line
                fields = rest.split(None, 4)
                path = fields[4].strip() if len(fields) == 5 else ""
                if path in files:
                    start, end = (int(x, 16) for x in head.split("-"))
                    current = [start, end, 0, 0]
                    out.append(current)  # type: ignore[arg-type]
                else:
                    current = None
            elif current is not None and head in ("Rss:", "Anonymous:"):
                kib = int(rest.split()[0]) * 1024
                current[2 if head == "Rss:" else 3] += kib
    return [tuple(m) for m in out]  # type: ignore[misc]


def _c_library() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc
