"""Hot reload of the handler's code inside a worker: the two steps the server asks for in RELOAD
frames (docs/protocol.md, Hot reload; docs/hot-reload.md).

``prepare`` imports the model's own modules afresh (every module whose file is in the model
folder: the handler, its helpers, the ``modelFile``) as new module objects, and loads a new
handler from them with the worker's context, while the old handler and its modules stay as they
were and keep serving. ``commit`` switches the service to the new handler and its modules and
runs the old handler's ``shutdown()``; ``abort`` drops the new one. What the new code asks the
keep store for (:mod:`.sdk.keep`) while it loads is found there, not loaded again: that is how
weights survive a code change.

The new code is compiled from its source, never from ``__pycache__``: an edit within the same
second as the last compile, of the same size, would look unchanged to the bytecode cache.
Runs inside a worker: standard library only, Python 3.8+.
"""

from __future__ import annotations

import hashlib
import importlib
import linecache
import os
import sys
import time
import traceback
from collections.abc import Hashable
from types import ModuleType, TracebackType
from typing import Any, Protocol

from .contract import HandlerLoadError, LoadedHandler
from .loader import load_handler
from .oip import serving as oip_serving
from .reload_frames import Reloaded
from .sdk.keep import STORE

# A bytecode cache folder that cannot exist (a path below a character device): the import
# system finds no cached bytecode there and writes none, so the source is compiled.
_NO_BYTECODE = os.path.join(os.devnull, "mserve-reload")
# Folders inside a model folder whose modules are installed packages, not the model's own code.
_INSTALLED = ("site-packages", "dist-packages")


class Service(Protocol):
    """What a reload changes of the worker's loaded handler (:class:`.service.HandlerService`,
    which imports this module: a Protocol keeps the two out of a circle)."""

    handler: LoadedHandler
    context: Any
    init: dict[str, Any]  # INIT's meta: the handler entry, its style, the envelope
    code: dict[str, Any] | None


class _Prepared:
    """A new handler loaded beside the serving one, waiting for commit or abort."""

    def __init__(
        self, reload_id: int, handler: LoadedHandler, new: dict[str, ModuleType],
        old: dict[str, ModuleType], code: dict[str, Any], keys: frozenset[Hashable],
    ) -> None:  # fmt: skip
        self.reload_id = reload_id
        self.handler = handler
        self.new = new
        self.old = old
        self.code = code
        self.keys = keys


class Reloader:
    """The reload steps of one service (the worker's loaded handler)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self._prepared: _Prepared | None = None

    def step(self, reload_id: int, step: str) -> Reloaded:
        """Run one step; a failure of ours (never the user's code, which prepare reports) is
        answered as the step's failure, and the worker serves on with the code it had."""
        try:
            if step == "prepare":
                return self.prepare(reload_id)
            if step == "commit":
                return self.commit(reload_id)
            return self.abort(reload_id)
        except Exception as exc:  # the worker's boundary for a reload step
            details = traceback.format_exc()
            print(details, file=sys.stderr)
            error = f"internal error in the worker's reload {step}: {exc!r}"
            return Reloaded(reload_id, step, False, error=error, traceback=details)

    def prepare(self, reload_id: int) -> Reloaded:
        """Load the code on disk as a new handler beside the serving one."""
        if self._prepared is not None:  # an earlier reload that never ended: it is over
            self.abort(self._prepared.reload_id)
        service = self.service
        init = service.init
        model_dir = init["model_dir"]
        started = time.monotonic()
        old = own_modules(model_dir)
        for name in old:
            del sys.modules[name]
        prefix, no_write = sys.pycache_prefix, sys.dont_write_bytecode
        sys.pycache_prefix, sys.dont_write_bytecode = _NO_BYTECODE, True
        importlib.invalidate_caches()
        linecache.checkcache()  # tracebacks quote the new lines, not cached old ones
        STORE.begin()
        try:
            handler = load_handler(
                init["handler"], model_dir, service.context, init.get("handler_style")
            )
        except BaseException as exc:  # the user's code: a syntax error, initialize raising
            details = traceback.format_exc()
            print(details, file=sys.stderr)
            _swap_modules(own_modules(model_dir), old)
            STORE.abort(STORE.end())
            where = _where(exc, model_dir)
            return Reloaded(
                reload_id, "prepare", False, error=_error_text(exc, where), traceback=details,
                file=where[0] if where else None, line=where[1] if where else None,
            )  # fmt: skip
        finally:
            sys.pycache_prefix, sys.dont_write_bytecode = prefix, no_write
        keys = STORE.end()
        new = own_modules(model_dir)
        code = code_of(model_dir, new, handler)
        # until the switch the old code serves, and its imports inside functions find its own
        _swap_modules(new, old)
        self._prepared = _Prepared(reload_id, handler, new, old, code, keys)
        load_s = round(time.monotonic() - started, 4)
        return Reloaded(reload_id, "prepare", True, code=code, load_s=load_s, kept=len(keys))

    def commit(self, reload_id: int) -> Reloaded:
        """Serve with the prepared handler; the old one's ``shutdown()`` runs (its failure is
        logged: the new code serves all the same)."""
        prepared = self._prepared
        if prepared is None or prepared.reload_id != reload_id:
            return Reloaded(reload_id, "commit", False, error=_nothing_prepared(reload_id))
        self._prepared = None
        service = self.service
        _swap_modules(prepared.old, prepared.new)
        old_handler, service.handler = service.handler, prepared.handler
        if prepared.handler.style != old_handler.style:  # its requests are read another way
            service.context._mserve_oip = None  # type: ignore[attr-defined]
            oip_serving.for_context(
                service.context, prepared.handler.style, service.init.get("service_envelope") or ""
            )
        service.code = prepared.code
        released = STORE.commit(prepared.keys)
        if released:
            print(f"mserve-worker: released {released} kept object(s) the new code did not ask for",
                  file=sys.stderr)  # fmt: skip
        try:
            old_handler.shutdown()
        except Exception:  # the old code's stop hook: the new code serves all the same
            traceback.print_exc()
        return Reloaded(reload_id, "commit", True, code=prepared.code)

    def abort(self, reload_id: int) -> Reloaded:
        """Drop the prepared handler (if any): the old code goes on serving."""
        prepared = self._prepared
        if prepared is not None and prepared.reload_id == reload_id:
            self._prepared = None
            STORE.abort(prepared.keys)
            try:
                prepared.handler.shutdown()
            except Exception:  # code that never served: nothing of it is needed
                traceback.print_exc()
        return Reloaded(reload_id, "abort", True, code=self.service.code)


def own_modules(model_dir: str) -> dict[str, ModuleType]:
    """The imported modules whose files are in the model folder: the model's own code. A
    module's path is compared as a string first (the model folder as given and its real path:
    modules are imported through the one on ``sys.path``), so the hundreds of library modules
    a worker holds cost no system call each."""
    folder = os.path.realpath(model_dir)
    prefixes = tuple({os.path.join(os.path.abspath(model_dir), ""), os.path.join(folder, "")})
    own = {}
    for name, module in list(sys.modules.items()):
        raw = _raw_path(module)
        if raw is None or not raw.startswith(prefixes):
            continue
        path = os.path.realpath(raw)
        if _inside(path, folder):
            own[name] = module
    return own


def code_of(model_dir: str, modules: dict[str, ModuleType], handler: LoadedHandler) -> dict:
    """The code a handler runs, as describe shows it: the sha256 of its model's own module files
    (path and bytes; the handler's module too when it is a built-in one) and their paths."""
    folder = os.path.realpath(model_dir)
    paths = {p for p in (_module_path(m) for m in modules.values()) if p and os.path.isfile(p)}
    handler_path = _module_path(handler.module) if handler.module is not None else None
    if handler_path and os.path.isfile(handler_path):
        paths.add(handler_path)
    digest = hashlib.sha256()
    files = []
    for path in sorted(paths):
        shown = os.path.relpath(path, folder) if _inside(path, folder) else path
        files.append(shown)
        digest.update(shown.encode("utf-8", "surrogateescape") + b"\0")
        try:
            with open(path, "rb") as f:
                digest.update(f.read())
        except OSError:
            pass
        digest.update(b"\0")
    return {"digest": "sha256:" + digest.hexdigest(), "files": files}


def _raw_path(module: Any) -> str | None:
    """A module's file as it was imported (a namespace package: its first folder)."""
    path = getattr(module, "__file__", None)
    if isinstance(path, str):
        return path
    paths = getattr(module, "__path__", None)  # a namespace package
    try:
        first = next(iter(paths)) if paths is not None else None
    except (StopIteration, TypeError):
        return None
    return first if isinstance(first, str) else None


def _module_path(module: Any) -> str | None:
    raw = _raw_path(module)
    return None if raw is None else os.path.realpath(raw)


def _inside(path: str, folder: str) -> bool:
    try:
        if os.path.commonpath([path, folder]) != folder:
            return False
    except ValueError:
        return False
    return not any(part in _INSTALLED for part in os.path.relpath(path, folder).split(os.sep))


def _swap_modules(out: dict[str, ModuleType], back: dict[str, ModuleType]) -> None:
    """Take ``out`` out of ``sys.modules`` (only where it is still what is there) and put
    ``back`` in."""
    for name, module in out.items():
        if sys.modules.get(name) is module:
            del sys.modules[name]
    sys.modules.update(back)


def _where(exc: BaseException, model_dir: str) -> tuple[str, int | None] | None:
    """Where in the model's own code ``exc`` was raised: the file (relative to the model
    folder) and line of a syntax error, else the innermost frame of the traceback in the model
    folder; None when no frame is the model's (the error is ours or a library's)."""
    folder = os.path.realpath(model_dir)
    if isinstance(exc, SyntaxError) and exc.filename:
        path = os.path.realpath(exc.filename)
        return _shown(path, folder), exc.lineno
    found = None
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        path = os.path.realpath(tb.tb_frame.f_code.co_filename)
        if _inside(path, folder):
            found = (_shown(path, folder), tb.tb_lineno)
        tb = tb.tb_next
    return found


def _shown(path: str, folder: str) -> str:
    return os.path.relpath(path, folder) if _inside(path, folder) else path


def _error_text(exc: BaseException, where: tuple[str, int | None] | None) -> str:
    """One line: the exception, and where in the model's code it was raised."""
    if isinstance(exc, HandlerLoadError):
        return str(exc)
    text = f"{type(exc).__name__}: {exc}"
    if where is not None and not isinstance(exc, SyntaxError):  # its text says where already
        text += f" ({where[0]}, line {where[1]})"
    return text


def _nothing_prepared(reload_id: int) -> str:
    return f"no reload {reload_id} was prepared in this worker; nothing to commit"
