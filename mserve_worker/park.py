"""A parked worker: an evicted model's idle worker kept alive, its handler built, until a wake.

With the warm tier on, an evicted model's weights stay in the page cache (the server maps
them). Waking it by starting a worker still costs a fork from the template, INIT, the handler's
import and load and the module's build: 0.1 s on an idle machine for 512 MiB, 0.3 s and more
under load. A parked worker skips all of it. When its model is evicted the server sends
``park``: the worker collects its garbage and hands its C heap's free pages back to the kernel
(``malloc_trim``), and keeps everything else, its mappings of the weights included: those pages
are the page cache's, which the warm tier holds anyway, so keeping them mapped costs a page
table, and spares the wake a page fault per folio (dropping them, ``MADV_DONTNEED``, was tried:
the wake then paid 0.08 s at the median, under load, to map 512 MiB again). A wake needs no
frame: the worker serves its next batch with the handler it already built.

Runs inside a worker, in the model's environment: standard library only, Python 3.8.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from typing import Any

from .park_frames import Parked

_libc: Any = None


def park(park_id: int, mapped_bytes: int) -> Parked:
    """Answer a PARK frame (``mapped_bytes``: the size of the checkpoints this worker mapped,
    which it keeps); never raises: a failure is the answer's ``error``."""
    started = time.perf_counter()
    try:
        gc.collect()
        _trim()
    except (OSError, ValueError) as exc:
        return Parked(park_id, False, error=f"cannot park: {exc}")
    return Parked(park_id, True, bytes=mapped_bytes, seconds=time.perf_counter() - started)


def _trim() -> None:
    """glibc: the free pages of the C heap back to the kernel (the handler's load and its
    requests freed more than a parked worker needs); nothing elsewhere."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name) if name else False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None
    if trim is not None:
        trim(0)
