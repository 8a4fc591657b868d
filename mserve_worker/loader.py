"""Load the manifest's ``handler`` entry point as one ``handle(batch, context) -> list`` callable.

This runs inside a worker process, in the model's own Python environment: standard library only,
Python 3.8+, nothing done at import time. The runtime has already put the model folder first on
``sys.path``.

Entry forms, as TorchServe and MMS read them (a ``path/`` prefix and a ``.py`` suffix on the
module are dropped, as those servers do):

``module:function``
    ``function(data, context)`` is called once with ``data=None`` at load, so that it can
    initialise, then once per batch. Style ``module-function``. When the module has no
    attribute of that name but defines exactly one handler class, that class is used instead,
    as TorchServe's loader does (``handler.py:handle`` over a file holding only a class).
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

Handler styles written for other servers are recognised from what the entry point defines, and
wrapped by their adapter in :mod:`mserve_worker.sdk` (one module per style):

``kernel``
    A class with ``on_task_invoke(task_context)`` (a ``Kernel`` subclass).
``v2-model``
    A class with ``load()`` and ``predict(request)`` (a ``V2ModelServer`` subclass).
``hooks``
    A module with no ``handle`` and no handler class, defining ``init_hook``, ``preprocess``
    and/or ``postprocess`` (functions, or lists of them for a pipeline); run with a driver.

The archive can name the style (``model-archiver --handler-style``) where detection would guess
wrong; the names are those in :data:`.contract.STYLES`. A name in :data:`sdk.BUILTIN_HANDLERS`
(``image_classifier``, ...) that is not a module in the model folder loads our built-in handler.

Exceptions the user's code raises while importing or initialising (an ``ImportError`` for a
dependency that is not installed included) propagate as they are, traceback and all.
:class:`HandlerLoadError` is only for what this module finds wrong with the entry point itself.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import inspect
import logging
import os
import sys
from typing import Any

from .contract import (
    CLASS_INSTANCE,
    HANDLER_CLASS,
    HOOKS,
    KERNEL,
    MODULE_FUNCTION,
    STYLES,
    V2_MODEL,
    HandlerLoadError,
    LoadedHandler,
    create_instance,
)
from .coroutines import settle

_NEEDS = (
    f"{MODULE_FUNCTION}: a handle(data, context) function (or name one as module:function); "
    f"{HANDLER_CLASS}: a class with handle(data, context) and optionally initialize(context); "
    f"{KERNEL}: a Kernel subclass with on_task_invoke(task_context); "
    f"{V2_MODEL}: a V2ModelServer subclass with load() and predict(request); "
    f"{HOOKS}: init_hook/preprocess/postprocess functions (or lists of them) run with a driver"
)

# Top-level import names of mserve itself, which share sys.path with the model's files.
_OWN_PACKAGES = ("mserve_worker",)
_FORMS = "expected module, module:function or pkg.module:Class"
_log = logging.getLogger(__name__)


def load_handler(
    handler: str, model_dir: str, context: Any, style: str | None = None
) -> LoadedHandler:
    """Import the entry point ``handler`` from ``model_dir``, initialise it and wrap it.

    ``style`` is the archive's ``--handler-style`` (None or ``"auto"``: detect it).
    """
    if style in (None, "", "auto"):
        style = None
    elif style not in STYLES:
        raise HandlerLoadError(
            f"unknown handler style {style!r} in the manifest; known: auto, {', '.join(STYLES)}"
        )
    module_name, attribute = _parse(handler)
    _refuse_clashes(model_dir)
    _refuse_shadowed(module_name, model_dir)
    module = _import(_builtin_or(module_name, model_dir), model_dir)

    if attribute is None:
        if style == HOOKS:
            return _adapter(HOOKS).load(module, module, context)
        entry = getattr(module, "handle", None)
        if style in (None, MODULE_FUNCTION) and callable(entry) and not inspect.isclass(entry):
            attribute, target = "handle", entry
        else:
            target = _only_class(module, style)
            if target is None:
                return _adapter(HOOKS).load(module, module, context)
            attribute = target.__name__
    elif hasattr(module, attribute):
        target = getattr(module, attribute)
    else:
        target = _class_in_place_of(module, attribute, style)
        attribute = target.__name__
    return _wrap(target, f"{module_name}:{attribute}", module, context, style)


# The SDK module that claims and loads each style written for another server.
_ADAPTERS = {KERNEL: "kernel", HOOKS: "hooks", V2_MODEL: "v2_serving"}


def _adapter(style: str) -> Any:
    """The adapter module of a style written for another server (imported only when used)."""
    return importlib.import_module(f"{__package__}.sdk.{_ADAPTERS[style]}")


def _builtin_or(module_name: str, model_dir: str) -> str:
    """A built-in handler's module, unless the model ships a module of that name itself."""
    from .sdk import BUILTIN_HANDLERS

    if module_name in BUILTIN_HANDLERS and not _module_files(module_name, model_dir):
        return f"{__package__}.sdk.{module_name}"
    return module_name


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


def _class_styles(cls: type) -> list[str]:
    """Every style whose contract the class meets (more than one is ambiguous)."""
    styles = []
    if callable(getattr(cls, "handle", None)):
        styles.append(HANDLER_CLASS)
    if _adapter(KERNEL).claims(cls):
        styles.append(KERNEL)
    if _adapter(V2_MODEL).claims(cls):
        styles.append(V2_MODEL)
    return styles


def _handler_classes(module: Any, style: str | None) -> list[type]:
    """The classes defined in ``module`` that fit ``style`` (any style when None)."""
    defined = [value for _, value in _defined_here(module) if inspect.isclass(value)]
    if style:
        return [cls for cls in defined if style in _class_styles(cls)]
    classes = [cls for cls in defined if _class_styles(cls)]
    if not classes and not _adapter(HOOKS).claims(module):
        # A half-written handler class (initialize, no handle): load it to say what it lacks.
        # In a hooks file such a class is a helper, and the module loads as hooks.
        classes = [cls for cls in defined if hasattr(cls, "initialize")]
    return classes


def _class_in_place_of(module: Any, attribute: str, style: str | None) -> type:
    """TorchServe's fallback for ``module:name`` when the module has no ``name``: its one
    handler class. Archives made for TorchServe name ``handler.py:handle`` over a file that
    defines only a class, and TorchServe serves them."""
    classes = _handler_classes(module, style)
    if len(classes) == 1:
        _log.info(
            "module %r has no %r; using its one handler class %s instead, as TorchServe does",
            module.__name__,
            attribute,
            classes[0].__name__,
        )
        return classes[0]
    found = (
        f"it defines {len(classes)} handler classes ({', '.join(c.__name__ for c in classes)}); "
        f"name one, e.g. '{module.__name__}:{classes[0].__name__}'"
        if classes
        else f"it defines: {_describe_callables(module)}"
    )
    raise HandlerLoadError(
        f"module {module.__name__!r} has no attribute {attribute!r}, and no single handler "
        f"class to use in its place; {found}"
    )


def _only_class(module: Any, style: str | None) -> type | None:
    """The one handler class the module defines; None when it has none but looks like hooks."""
    classes = _handler_classes(module, style)
    if len(classes) == 1:
        return classes[0]
    if not classes:
        if style is None and _adapter(HOOKS).claims(module):
            return None
        fits = (
            f"does not fit the archive's handler style {style!r}"
            if style
            else "fits no handler style"
        )
        raise HandlerLoadError(
            f"module {module.__name__!r} {fits}: it has no handle(data, context) function and no "
            f"class or hooks a style needs; it defines: {_describe_callables(module)}. "
            f"Each style needs: {_NEEDS}"
        )
    names = ", ".join(cls.__name__ for cls in classes)
    raise HandlerLoadError(
        f"module {module.__name__!r} defines {len(classes)} handler classes ({names}); "
        f"name the one to use in the handler, e.g. '{module.__name__}:{classes[0].__name__}'"
    )


def _wrap(target: Any, label: str, module: Any, context: Any, style: str | None) -> LoadedHandler:
    if inspect.isclass(target):
        return _from_class(target, label, module, context, style)
    if style not in (None, MODULE_FUNCTION):
        raise HandlerLoadError(
            f"handler {label!r} is a {type(target).__name__}, but the archive says its style is "
            f"{style!r}, which needs a class"
        )
    if inspect.isroutine(target):
        settle(target(None, context))  # the initialisation call TorchServe and MMS make at load
        return LoadedHandler(MODULE_FUNCTION, target, module=module)
    handle = getattr(target, "handle", None)
    if callable(handle):
        _initialize(target, context)
        return LoadedHandler(CLASS_INSTANCE, handle, instance=target, module=module)
    if callable(target):
        settle(target(None, context))
        return LoadedHandler(CLASS_INSTANCE, target, instance=target, module=module)
    raise HandlerLoadError(
        f"handler {label!r} is a {type(target).__name__}, not a function, a class or an object "
        f"with a handle method"
    )


def _from_class(
    cls: type, label: str, module: Any, context: Any, style: str | None
) -> LoadedHandler:
    fits = _class_styles(cls)
    if style is None:
        if len(fits) > 1:
            raise HandlerLoadError(
                f"handler class {label!r} fits several styles ({', '.join(fits)}); name one with "
                f"model-archiver --handler-style"
            )
        style = fits[0] if fits else HANDLER_CLASS
    elif style not in fits:
        raise HandlerLoadError(
            f"handler class {label!r} does not fit the archive's handler style {style!r}"
            f"{' (it fits ' + ', '.join(fits) + ')' if fits else ''}. Each style needs: {_NEEDS}"
        )
    if style != HANDLER_CLASS:
        return _adapter(style).load(cls, module, context)
    if not callable(getattr(cls, "handle", None)):
        raise HandlerLoadError(
            f"handler class {label!r} has no handle(data, context) method. "
            f"Each style needs: {_NEEDS}"
        )
    instance = create_instance(cls, label)
    _initialize(instance, context)
    return LoadedHandler(HANDLER_CLASS, instance.handle, instance=instance, module=module)


def _initialize(instance: Any, context: Any) -> None:
    initialize = getattr(instance, "initialize", None)
    if callable(initialize):
        settle(initialize(context))  # an async def initialize is awaited too
