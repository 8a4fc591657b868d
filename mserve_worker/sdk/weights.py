"""Weights mapped from the page cache: what lets an evicted model wake in a fraction of its load.

``torch.load`` of a checkpoint reads the whole file, unpickles it and copies every tensor into
fresh memory; building the model first fills its parameters with a random initialisation that
the state dict then overwrites. For a model of a GiB that is seconds, paid again at every load.
With the server's warm tier on (``warm_tier_budget_mb``, docs/warm-tier.md), this module loads
torch zip checkpoints (what ``torch.save`` writes since torch 1.6) with ``mmap=True``: each
tensor's storage is a private, copy-on-write mapping of the file, so its pages come straight
from the page cache, where the server keeps an evicted model's weights, and are shared by every
worker of the model. ``BaseHandler`` then builds the model on the ``meta`` device and assigns
the mapped tensors to it, skipping the initialisation and the copy.

Built-in handlers (``BaseHandler``, the hooks drivers) load through here without a change. A
handler that calls ``torch.load`` itself calls :func:`load_weights` instead, with the same
arguments. The files mapped are reported to the server with READY (``mapped``), which keeps
their pages when the model is evicted. What is not a zip checkpoint (TorchScript, ONNX, the
legacy pickle format) loads as before and is not kept warm.

Runs inside a worker, in the model's environment: standard library at import time.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import zipfile
from typing import Any

_MADV_POPULATE_READ = 22  # linux/mman.h
_libc: Any = None

_enabled = False  # set from INIT's warm_tier by the service (mserve_worker/service.py)
_mapped: dict[str, int] = {}  # real path: size in bytes, of each file mapped by this worker


def enable(on: bool) -> None:
    """Whether this worker maps weights (the server's warm tier is on)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def mapped_files() -> list[list[Any]]:
    """``[[path, bytes], ...]`` of the files this worker mapped, for READY."""
    return [[path, size] for path, size in sorted(_mapped.items())]


def load_weights(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
    """``torch.load(path, ...)``, mapped from the page cache when the warm tier is on and the
    file is a torch zip checkpoint; the same objects either way (tensors of the same values).

    ``weights_only`` defaults to True here, as in torch 2.6 and later. A file that is not a
    zip checkpoint, or that torch refuses to map, loads with a plain ``torch.load``."""
    import torch

    kwargs.setdefault("weights_only", True)
    name = os.fspath(path)
    if not _enabled or kwargs.get("mmap") is False or not _is_zip_checkpoint(name):
        kwargs.pop("mmap", None)
        return torch.load(name, *args, **kwargs)
    kwargs["mmap"] = True
    loaded = torch.load(name, *args, **kwargs)
    real = os.path.realpath(name)
    _mapped[real] = os.path.getsize(real)
    _populate(loaded)
    return loaded


def is_mapped(path: str | os.PathLike[str]) -> bool:
    """Whether :func:`load_weights` mapped ``path`` in this worker."""
    return os.path.realpath(os.fspath(path)) in _mapped


def build_with_state(cls: Any, state: Any) -> Any:
    """``cls()`` holding ``state``: built on the ``meta`` device and given the state's tensors
    (``load_state_dict(assign=True)``) when they are mapped, so no random initialisation runs
    and nothing is copied; otherwise, or when the module keeps a tensor the state dict does not
    hold (a buffer computed in ``__init__``), built normally and loaded by copy."""
    import torch

    try:
        with torch.device("meta"):
            model = cls()
        model.load_state_dict(state, assign=True)
    except (RuntimeError, TypeError, NotImplementedError):
        model = None  # the normal way below says what is wrong, if anything
    if model is not None and not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return model
    model = cls()
    model.load_state_dict(state)
    return model


def _populate(loaded: Any) -> None:
    """Map every page of the loaded tensors now (``MADV_POPULATE_READ``, Linux 5.14+; else one
    read per page), so the model is whole when READY is sent: the server measures the worker's
    PSS then, and it must count the weights; the first request would pay the same faults."""
    import torch

    if isinstance(loaded, torch.nn.Module):
        loaded = loaded.state_dict()
    tensors = loaded.values() if isinstance(loaded, dict) else ()
    seen: set[int] = set()
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_meta:
            continue
        storage = t.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        if not size or start in seen:
            continue
        seen.add(start)
        if not _madvise_populate(start, size):
            flat = torch.empty(0, dtype=torch.uint8).set_(storage)
            int(flat[:: mmap.PAGESIZE].sum())  # one byte of each page


def _madvise_populate(start: int, size: int) -> bool:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page = start - start % mmap.PAGESIZE
        return _libc.madvise(page, size + (start - page), _MADV_POPULATE_READ) == 0
    except (OSError, AttributeError):
        return False


def _is_zip_checkpoint(path: str) -> bool:
    """What ``torch.load(mmap=True)`` can map: ``torch.save``'s zip format (TorchScript files
    are zips too, but hold ``constants.pkl``; they load with ``torch.jit.load``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return False
    return any(n.endswith("/data.pkl") for n in names) and not any(
        n.endswith("/constants.pkl") for n in names
    )
