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
their pages when the model is evicted. A checkpoint in torch's legacy format is converted
once into a mappable copy (convert.py) and that copy mapped. What is not a checkpoint
(TorchScript, ONNX) loads as before and is not kept warm.

Runs inside a worker, in the model's environment: standard library at import time.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
import zipfile
from collections.abc import Iterator
from typing import Any

from . import convert

_MADV_POPULATE_READ = 22  # linux/mman.h (Linux 5.14+)
_enabled = False  # set from INIT's warm_tier by the service (mserve_worker/service.py)
_mapped: dict[str, int] = {}  # real path: size in bytes, of each file mapped by this worker
_copies: dict[str, str] = {}  # real path of a legacy checkpoint: its mappable copy (convert.py)
_timings = {"weights_s": 0.0, "populate_s": 0.0}  # this worker's time in load_weights, of which
# touching the pages


def enable(on: bool) -> None:
    """Whether this worker maps weights (the server's warm tier is on)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def timings() -> dict[str, float]:
    """Seconds this worker spent in :func:`load_weights` (``weights_s``) and, of those,
    mapping the pages (``populate_s``) and converting legacy checkpoints (``convert_s``, only
    when it did: the server then counts its load cold): READY's ``phases``, which the server
    logs."""
    out = {k: round(v, 4) for k, v in _timings.items()}
    if convert.converted_s():
        out["convert_s"] = max(round(convert.converted_s(), 4), 0.0001)  # never 0 when it did
    return out


def mapped_files() -> list[list[Any]]:
    """``[[path, bytes], ...]`` of the files this worker mapped, for READY."""
    return [[path, size] for path, size in sorted(_mapped.items())]


def load_weights(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
    """``torch.load(path, ...)``, mapped from the page cache when the warm tier is on and the
    file is a torch zip checkpoint; the same objects either way (tensors of the same values).

    ``weights_only`` defaults to True here, as in torch 2.6 and later. A file that is not a
    zip checkpoint, or that torch refuses to map, loads with a plain ``torch.load``."""
    started = time.monotonic()
    try:
        return _load(os.fspath(path), args, kwargs)
    finally:
        _timings["weights_s"] += time.monotonic() - started


def _load(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    import torch

    kwargs.setdefault("weights_only", True)
    source = name
    if _enabled and kwargs.get("mmap") is not False and not _is_zip_checkpoint(name):
        name = _mappable_copy(name, args, kwargs) or name
    if not _enabled or kwargs.get("mmap") is False or not _is_zip_checkpoint(name):
        kwargs.pop("mmap", None)
        return torch.load(name, *args, **kwargs)
    kwargs["mmap"] = True
    _read_ahead(name)
    loaded = torch.load(name, *args, **kwargs)
    real = os.path.realpath(name)
    if name != source:
        _copies[os.path.realpath(source)] = real
    _mapped[real] = os.path.getsize(real)
    started = time.monotonic()
    _populate(loaded)
    _timings["populate_s"] += time.monotonic() - started
    return loaded


def _mappable_copy(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The mappable copy of a legacy checkpoint (convert.py), made now if need be; None when
    ``name`` is none, or the load asks for more than a location and ``weights_only`` (its own
    unpickler, say), which the conversion could not honour."""
    if args or set(kwargs) - {"map_location", "weights_only", "mmap"}:
        return None
    if not convert.is_legacy(name):
        return None
    return convert.mappable(name, bool(kwargs["weights_only"]))


def is_mapped(path: str | os.PathLike[str]) -> bool:
    """Whether :func:`load_weights` mapped ``path`` (or its mappable copy) in this worker."""
    real = os.path.realpath(os.fspath(path))
    return _copies.get(real, real) in _mapped


def build_with_state(cls: Any, state: Any) -> Any:
    """``cls()`` holding ``state``: built on the ``meta`` device and given the state's tensors
    (``load_state_dict(assign=True)``) when they are mapped, so no random initialisation runs
    and nothing is copied; otherwise, or when the module keeps a tensor the state dict does not
    hold (a buffer computed in ``__init__``), built normally and loaded by copy."""
    import torch

    try:
        with torch.device("meta"), _no_init(torch.nn.init):
            model = cls()
        model.load_state_dict(state, assign=True)
    except (RuntimeError, TypeError, NotImplementedError):
        model = None  # the normal way below says what is wrong, if anything
    if model is not None and not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return model
    model = cls()
    model.load_state_dict(state)
    return model


def _read_ahead(path: str) -> None:
    """Bring a file that is not all in the page cache in through a mapping of our own, with
    the kernel's usual readahead: it then sits in large folios, which a fault maps many pages
    of at once. Pages faulted in through torch's own mapping of it came in one by one, and
    every later wake paid for it when touching them (0.15 against 0.02 s of CPU for 1 GiB).
    A file all in the page cache (a wake) costs a few hundred one-byte reads."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        size = os.fstat(fd).st_size
        if not size or _all_cached(fd, size):
            return
        view = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
        try:
            view.madvise(_MADV_POPULATE_READ)
        finally:
            view.close()
    except (OSError, ValueError, AttributeError):
        pass  # nothing lost: torch's mapping reads the pages in as before
    finally:
        os.close(fd)


def _all_cached(fd: int, size: int, samples: int = 256) -> bool:
    """Whether the page cache holds the file's pages, as ``samples`` pages spread over it
    tell: a read that must not wait for the disk (``RWF_NOWAIT``) fails on a page it lacks.
    Not ``mincore``: to a process that may not write the file (a worker under its model's own
    uid) it calls every page cached; nor all pages: for 262,144 of them that took 24 ms of
    CPU, as much as touching them. A sample misjudged only makes later wakes slower."""
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None or not hasattr(os, "preadv"):
        return True  # no way to ask: as before
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    buffer = [bytearray(1)]
    count = min(samples, pages)
    for i in range(count):
        try:
            os.preadv(fd, buffer, i * pages // count * mmap.PAGESIZE, nowait)
        except BlockingIOError:
            return False
        except OSError:  # a file system without RWF_NOWAIT
            return True
    return True


@contextlib.contextmanager
def _no_init(init: Any) -> Iterator[None]:
    """``torch.nn.init``'s initialisers do nothing meanwhile: on the ``meta`` device they
    compute nothing anyway, but each still ran through torch's dispatch (three quarters of the
    time to build a stack of ``Linear`` layers there)."""
    saved = {
        name: fn for name, fn in vars(init).items()
        if name.endswith("_") and not name.startswith("_") and callable(fn)
    }  # fmt: skip
    for name in saved:
        setattr(init, name, _unchanged)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def _unchanged(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    return tensor


def _populate(loaded: Any) -> None:
    """Map every page of the loaded tensors now, so the model is whole when READY is sent: the
    server measures the worker's PSS then, and it must count the weights (the first request
    would pay the same faults). One read per page: each fault maps the pages around it that
    the page cache holds (fault-around, large folios), so it costs a quarter of what
    ``MADV_POPULATE_READ`` does, which walks the range page by page (20 against 65 ms of CPU
    for 1 GiB held in the page cache, measured with scripts/bench_warm.py's model)."""
    import torch

    if isinstance(loaded, torch.nn.Module):
        loaded = loaded.state_dict()
    tensors = loaded.values() if isinstance(loaded, dict) else ()
    seen: set[int] = set()
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_meta:
            continue
        storage = t.untyped_storage()
        if not storage.nbytes() or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        int(flat[:: mmap.PAGESIZE].sum())  # one byte of each page


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
