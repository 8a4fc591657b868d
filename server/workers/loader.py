"""Load the manifest's ``handler`` entry point as one ``handle(batch, context) -> list`` callable.

This runs inside a worker process, in the model's own Python environment: standard library only,
Python 3.8+, nothing done at import time. The runtime has already put the model folder first on
``sys.path``.

Entry forms, as TorchServe and MMS read them (a ``path/`` prefix and a ``.py`` suffix on the
module are dropped, as those servers do):

``module:function``
    ``function(data, context)`` is called once with ``data=None`` at load, so that it can
    initialise, then once per batch. Style ``module-function``.
``module:Class``
    ``Class()`` is created with no arguments, ``initialize(context)`` is called when defined, and
    ``instance.handle`` serves batches. Style ``handler-class``.
``module:instance``
    An object with a ``handle`` method is used like an instance of a handler class
    (``initialize(context)`` first, when defined); a plain callable object like a function.
    Style ``class-instance``.
``module``
    The module's top-level ``handle`` when it has one (TorchServe's default entry point name),
    otherwise the one handler class defined in it (a class with ``handle`` and/or
    ``initialize``). Two or more such classes and no ``handle`` is an error naming them.

Exceptions the user's code raises while importing or initialising (an ``ImportError`` for a
dependency that is not installed included) propagate as they are, traceback and all.
:class:`HandlerLoadError` is only for what this module finds wrong with the entry point itself.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

MODULE_FUNCTION = "module-function"
HANDLER_CLASS = "handler-class"
CLASS_INSTANCE = "class-instance"

# Top-level import names of mserve itself, which share sys.path with the model's files.
_OWN_PACKAGES = ("archiver", "server")
_FORMS = "expected module, module:function or pkg.module:Class"


class HandlerLoadError(Exception):
    """The handler entry point cannot be found or used; the message is for the model's author."""


class LoadedHandler:
    """The handler, whatever its style, behind one call: ``handle(batch, context) -> list``."""

    def __init__(
        self,
        style: str,
        entry: Callable[[Any, Any], Any],
        instance: Any = None,
        module: Any = None,
    ) -> None:
        self.style = style
        self.instance = instance
        self.module = module
        self._entry = entry

    def handle(self, batch: list[Any], context: Any) -> list[Any] | None:
        """Call the handler with the whole batch and return what it returned, unchecked.

        An empty batch is answered with ``[]`` without calling the handler, since function-style
        handlers read an empty ``data`` as their initialisation call.
        """
        if not batch:
            return []
        return self._entry(batch, context)

    def shutdown(self) -> None:
        """Call the handler instance's ``shutdown()`` when it has one."""
        stop = getattr(self.instance, "shutdown", None)
        if callable(stop):
            stop()

    def __repr__(self) -> str:
        return f"LoadedHandler(style={self.style!r}, entry={self._entry!r})"


def load_handler(handler: str, model_dir: str, context: Any) -> LoadedHandler:
    """Import the entry point ``handler`` from ``model_dir``, initialise it and wrap it."""
    module_name, attribute = _parse(handler)
    _refuse_clashes(model_dir)
    _refuse_shadowed(module_name, model_dir)
    module = _import(module_name, model_dir)

    if attribute is None:
        entry = getattr(module, "handle", None)
        if entry is not None and callable(entry) and not inspect.isclass(entry):
            attribute, target = "handle", entry
        else:
            target = _only_handler_class(module)
            attribute = target.__name__
    else:
        if not hasattr(module, attribute):
            raise HandlerLoadError(
                f"module {module_name!r} has no attribute {attribute!r}; "
                f"it defines: {_describe_callables(module)}"
            )
        target = getattr(module, attribute)
    return _wrap(target, f"{module_name}:{attribute}", module, context)


def _parse(handler: str) -> tuple[str, str | None]:
    text = (handler or "").strip()
    if not text:
        raise HandlerLoadError(f"the manifest names no handler; {_FORMS}")
    if text.count(":") > 1:
        raise HandlerLoadError(f"handler {handler!r} has more than one ':'; {_FORMS}")
    module_part, colon, attribute = text.partition(":")
    module_part = module_part.replace("\\", "/").rsplit("/", 1)[-1]
    if module_part.endswith(".py"):
        module_part = module_part[: -len(".py")]
    if not module_part or not all(part.isidentifier() for part in module_part.split(".")):
        raise HandlerLoadError(
            f"handler {handler!r}: {module_part!r} is not a Python module name; {_FORMS}"
        )
    if colon and not attribute.isidentifier():
        raise HandlerLoadError(
            f"handler {handler!r}: {attribute!r} after ':' is not a Python name; {_FORMS}"
        )
    return module_part, attribute if colon else None


def _own_packages() -> tuple[str, ...]:
    """Our import names, plus the one this package was imported under when it was copied."""
    names = list(_OWN_PACKAGES)
    top = (__package__ or "").split(".", 1)[0]
    if top and top not in names:
        names.append(top)
    return tuple(names)


def _module_files(name: str, folder: str) -> list[str]:
    """Files in ``folder`` that ``import name`` would find there (module or package)."""
    found = []
    for suffix in importlib.machinery.all_suffixes():
        if os.path.isfile(os.path.join(folder, name + suffix)):
            found.append(name + suffix)
        if os.path.isfile(os.path.join(folder, name, "__init__" + suffix)):
            found.append(os.path.join(name, "__init__" + suffix))
    return found


def _refuse_clashes(model_dir: str) -> None:
    for name in _own_packages():
        if _module_files(name, model_dir):
            raise HandlerLoadError(
                f"model ships a top-level module {name!r} that clashes with mserve's own "
                f"package of that name; rename it (found in {model_dir})"
            )


def _refuse_shadowed(module_name: str, model_dir: str) -> None:
    """A model file named like a module already imported (``json.py``) would never load."""
    top = module_name.split(".", 1)[0]
    loaded = sys.modules.get(top)
    if loaded is None or not _module_files(top, model_dir):
        return
    where = getattr(loaded, "__file__", None)
    if where and _inside(where, model_dir):
        return  # imported from the model folder already: it is the handler
    raise HandlerLoadError(
        f"handler module {top!r} in {model_dir} has the name of a module the worker has already "
        f"imported ({where or 'built in'}), so Python would use that one; rename the handler file"
    )


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    try:
        return os.path.commonpath([path, folder]) == folder
    except ValueError:  # different drives
        return False


def _import(module_name: str, model_dir: str) -> Any:
    importlib.invalidate_caches()  # the model folder may be newer than the finders' caches
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only "the handler module itself is missing" is ours to explain. A missing dependency
        # imported inside the user's module is the user's error, reported as Python raised it.
        parts = module_name.split(".")
        missing = {".".join(parts[: i + 1]) for i in range(len(parts))}
        if exc.name not in missing:
            raise
        raise HandlerLoadError(
            f"handler module {module_name!r} not found in {model_dir}; "
            f"it has: {_describe_folder(model_dir)}"
        ) from None


def _describe_folder(folder: str) -> str:
    try:
        entries = sorted(os.listdir(folder))
    except OSError as exc:
        return f"(cannot list it: {exc.strerror})"
    names = [e for e in entries if e.endswith(".py") and os.path.isfile(os.path.join(folder, e))]
    names += [e + "/" for e in entries if os.path.isfile(os.path.join(folder, e, "__init__.py"))]
    if not names:
        return "no .py files"
    shown = ", ".join(names[:30])
    return shown if len(names) <= 30 else f"{shown}, ... ({len(names)} in all)"


def _defined_here(module: Any) -> list[tuple[str, Any]]:
    """Classes and functions whose home is ``module`` (not imported into it), in file order."""
    found = [
        (name, value)
        for name, value in vars(module).items()
        if (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == module.__name__
    ]
    return found


def _describe_callables(module: Any) -> str:
    names = [name for name, _ in _defined_here(module) if not name.startswith("_")]
    return ", ".join(names) if names else "no public functions or classes"


def _only_handler_class(module: Any) -> type:
    classes = [
        value
        for _, value in _defined_here(module)
        if inspect.isclass(value) and (hasattr(value, "handle") or hasattr(value, "initialize"))
    ]
    if len(classes) == 1:
        return classes[0]
    if not classes:
        raise HandlerLoadError(
            f"module {module.__name__!r} has no handle(data, context) function and defines no "
            f"handler class (one with handle and initialize methods); it defines: "
            f"{_describe_callables(module)}"
        )
    names = ", ".join(cls.__name__ for cls in classes)
    raise HandlerLoadError(
        f"module {module.__name__!r} defines {len(classes)} handler classes ({names}); "
        f"name the one to use in the handler, e.g. '{module.__name__}:{classes[0].__name__}'"
    )


def _wrap(target: Any, label: str, module: Any, context: Any) -> LoadedHandler:
    if inspect.isclass(target):
        return _from_class(target, label, module, context)
    if inspect.isroutine(target):
        target(None, context)  # the initialisation call TorchServe and MMS make at load
        return LoadedHandler(MODULE_FUNCTION, target, module=module)
    handle = getattr(target, "handle", None)
    if callable(handle):
        _initialize(target, context)
        return LoadedHandler(CLASS_INSTANCE, handle, instance=target, module=module)
    if callable(target):
        target(None, context)
        return LoadedHandler(CLASS_INSTANCE, target, instance=target, module=module)
    raise HandlerLoadError(
        f"handler {label!r} is a {type(target).__name__}, not a function, a class or an object "
        f"with a handle method"
    )


def _from_class(cls: type, label: str, module: Any, context: Any) -> LoadedHandler:
    if not callable(getattr(cls, "handle", None)):
        raise HandlerLoadError(f"handler class {label!r} has no handle(data, context) method")
    try:
        inspect.signature(cls).bind()
    except TypeError:
        raise HandlerLoadError(
            f"handler class {label!r} cannot be created without arguments: "
            f"__init__{inspect.signature(cls)}"
        ) from None
    except ValueError:
        pass  # no signature to inspect (a class implemented in C); just try it
    instance = cls()
    _initialize(instance, context)
    return LoadedHandler(HANDLER_CLASS, instance.handle, instance=instance, module=module)


def _initialize(instance: Any, context: Any) -> None:
    initialize = getattr(instance, "initialize", None)
    if callable(initialize):
        initialize(context)
