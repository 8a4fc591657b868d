"""Legacy checkpoints made mappable, once: what lets the warm tier keep them too.

``torch.load(mmap=True)`` maps only torch's zip format (what ``torch.save`` writes since torch
1.6). A checkpoint in the legacy format (``_use_new_zipfile_serialization=False``, and what
older tools still write) is read and copied whole at every load. With the warm tier on, the
worker converts such a file once: it loads it exactly as the handler asked (the same
``weights_only``, so the same refusals; in this worker, under the model's sandbox, never in the
server), saves what it got in the zip format into the folder the server gave it for this model
version (INIT's ``mapped_dir``, beside the unpacked archives, never inside one), and maps that
copy from then on, as every later worker of the model does.

The copy's name holds the source file's identity (its path, device, inode, size and
modification time) and the ``weights_only`` it was loaded with, so a changed file, or a change
of rules, is converted again, and the copy of the old one removed. A file bigger than the warm
tier's budget (INIT's ``mapped_max_bytes``: it could never be kept warm) or than the free disk
allows is not converted and loads as before. Runs inside a worker: standard library at import.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

MIB = 2**20
PROGRESS_EVERY_S = 5.0  # a progress line while a big file is written
PROGRESS_FROM_BYTES = 256 * MIB
DISK_MARGIN_BYTES = 512 * MIB  # left free on the disk after a copy
# What a legacy torch file starts with: pickle protocol 2, then torch's magic number pickled
# as a long (torch/serialization.py, MAGIC_NUMBER)
_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."

_folder: str | None = None
_max_bytes = 0
_converted_s = 0.0  # this worker's time converting: READY's ``phases`` (weights.timings)


def configure(folder: Any, max_bytes: Any) -> None:
    """INIT's ``mapped_dir`` and ``mapped_max_bytes`` (absent: no conversion)."""
    global _folder, _max_bytes
    ok = isinstance(folder, str) and os.path.isabs(folder) and type(max_bytes) is int
    _folder, _max_bytes = (folder, max_bytes) if ok else (None, 0)


def converted_s() -> float:
    """Seconds this worker spent converting legacy checkpoints (0: it mapped copies already
    made, or none). A worker that converted read and converted its weights again: its load is
    a cold one, whatever the warm tier held (the server counts it so)."""
    return _converted_s


def is_legacy(path: str) -> bool:
    """Whether ``path`` is a checkpoint in torch's legacy (non-zip) format."""
    try:
        with open(path, "rb") as f:
            return f.read(len(_LEGACY_MAGIC)) == _LEGACY_MAGIC
    except OSError:
        return False


def mappable(path: str, weights_only: bool) -> str | None:
    """The zip-format copy of the legacy checkpoint ``path`` (converted now if there is none
    for this file as it is), or None when it is not to be converted (no folder, too big, no
    room). A failure to load the file raises as ``torch.load`` would have."""
    global _converted_s
    if _folder is None:
        return None
    st = os.stat(path)
    real = os.path.realpath(path)
    key = f"{real}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{weights_only}"
    stem = os.path.basename(real)
    target = os.path.join(_folder, f"{stem}.{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt")
    if os.path.exists(target):
        return target
    _remove_older(stem, target)
    if st.st_size > _max_bytes:
        log.info("%s is in torch's legacy format and %.0f MiB, over the warm tier's budget"
                 " (%.0f MiB): loaded unmapped, not converted", path, st.st_size / MIB,
                 _max_bytes / MIB)  # fmt: skip
        return None
    free = shutil.disk_usage(_folder).free
    if free < 2 * st.st_size + DISK_MARGIN_BYTES:  # the copy may take more than the source
        log.warning("%s is in torch's legacy format; not converted to a mappable copy: %.0f MiB"
                    " free in %s", path, free / MIB, _folder)  # fmt: skip
        return None
    started = time.monotonic()
    try:
        _convert(path, target, st.st_size, weights_only)
    finally:
        _converted_s += time.monotonic() - started
    return target


def _convert(source: str, target: str, size: int, weights_only: bool) -> None:
    import torch

    started = time.monotonic()
    log.info("converting %s (%.0f MiB, torch's legacy format) to a mappable copy, once: %s",
             source, size / MIB, target)  # fmt: skip
    loaded = torch.load(source, map_location="cpu", weights_only=weights_only)
    read_s = time.monotonic() - started
    partial = f"{target}.{os.getpid()}.partial"
    done = threading.Event()
    watcher = None
    if size >= PROGRESS_FROM_BYTES:
        watcher = threading.Thread(target=_progress, args=(partial, size, done), daemon=True)
        watcher.start()
    try:
        torch.save(loaded, partial)
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    finally:
        done.set()
        if watcher is not None:
            watcher.join()
    log.info("converted %s in %.1f s (read %.1f s, written %.1f s): later loads map it",
             source, time.monotonic() - started, read_s,
             time.monotonic() - started - read_s)  # fmt: skip


def _progress(partial: str, size: int, done: threading.Event) -> None:
    while not done.wait(PROGRESS_EVERY_S):
        try:
            written = os.path.getsize(partial)
        except OSError:
            continue
        log.info("converting: %.0f of about %.0f MiB written", written / MIB, size / MIB)


def _remove_older(stem: str, keep: str) -> None:
    """The copies of earlier versions of the same file (or of other rules), and what their
    conversions cut short left, go: one copy per file. Another worker's conversion of the same
    version (``keep``'s name) is left alone."""
    assert _folder is not None
    ours = re.compile(re.escape(stem) + r"\.[0-9a-f]{24}\.pt(\.\d+\.partial)?")
    for name in os.listdir(_folder):
        path = os.path.join(_folder, name)
        if not name.startswith(os.path.basename(keep)) and ours.fullmatch(name):
            with contextlib.suppress(OSError):
                os.unlink(path)
