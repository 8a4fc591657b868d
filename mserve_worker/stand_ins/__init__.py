"""Other servers' SDK import names (``redhareapi``, ``mlrun``), used only where they are missing.

Kernel files import ``from redhareapi import Kernel`` and mlrun model classes
``from mlrun.serving import V2ModelServer``; inside a worker those names resolve to mserve's
adapters (:mod:`mserve_worker.sdk.kernel`, :mod:`mserve_worker.sdk.v2_model`), so such files run
with no edit. Unlike ``ts`` (:mod:`mserve_worker.compat`: its real package cannot serve here, so
ours always wins), a real ``redhareapi`` or ``mlrun`` installed in the model's environment is
the one imported: our :class:`StandInFinder` sits last on ``sys.meta_path`` and answers only for
a name no other finder found. The stand-ins (in ``packages/``, never on ``sys.path``, so no
other name of ours becomes importable) provide only the names in :data:`PROVIDES`; anything else
in those packages fails with a message saying so.

Standard library only, Python 3.8+, nothing done at import time.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

STAND_IN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "packages")
# Per stand-in package, what it provides: the names the handler contracts we run use.
PROVIDES = {
    "redhareapi": ("redhareapi.Kernel",),
    "mlrun": ("mlrun.serving.V2ModelServer", "mlrun.serving.v2_serving.V2ModelServer"),
}


class StandInFinder:
    """The import finder of the stand-ins; consulted after every other finder has said no."""

    @classmethod
    def find_spec(cls, fullname: str, path: Any = None, target: Any = None) -> Any:
        top, _, rest = fullname.partition(".")
        if top not in PROVIDES:
            return None
        if not rest:
            return importlib.machinery.PathFinder.find_spec(fullname, [STAND_IN_DIR])
        # Our stand-in packages' own submodules were found by the path finder before us: what
        # reaches here is a submodule the real package has and the stand-in lacks.
        if is_stand_in(sys.modules.get(fullname.rpartition(".")[0])):
            raise ModuleNotFoundError(not_provided(fullname), name=fullname)
        return None


def install() -> None:
    """Make the stand-ins importable, behind everything else the worker can import."""
    if StandInFinder not in sys.meta_path:
        sys.meta_path.append(StandInFinder)


def is_stand_in(module: Any) -> bool:
    """Whether ``module`` is one of ours (not the real package's)."""
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and os.path.abspath(path).startswith(STAND_IN_DIR + os.sep)


def real_packages() -> list[tuple[str, str]]:
    """``(name, where)`` for each stand-in name that something else provides in this worker
    (installed in the environment, or shipped in the model's folder): that one is imported."""
    found = []
    for name in PROVIDES:
        spec = importlib.util.find_spec(name)
        where = spec and (spec.origin or next(iter(spec.submodule_search_locations or ()), None))
        if where and not where.startswith(STAND_IN_DIR + os.sep):
            found.append((name, str(where)))
    return found


def not_provided(fullname: str) -> str:
    """What the user is told when a file uses a name of the package that we do not provide."""
    top = fullname.partition(".")[0]
    return (
        f"{fullname} is not available: mserve's stand-in for {top} provides only "
        f"{' and '.join(PROVIDES[top])}, so that model files written for {top} run unedited; "
        f"install the real {top} package in the model's environment (its requirements) for "
        f"the rest"
    )


def missing(module_name: str, attribute: str) -> Exception:
    """The error a stand-in's module ``__getattr__`` raises for ``attribute``.

    ``from mlrun import x`` first asks ``hasattr`` from importlib's ``_handle_fromlist``, and an
    AttributeError there ends as a bare "cannot import name": for that caller an ImportError,
    which keeps our message. Everywhere else an AttributeError, so ``hasattr`` and
    ``getattr(module, name, default)`` behave as on any module.
    """
    if attribute.startswith("__") and attribute.endswith("__"):
        return AttributeError(f"module {module_name!r} has no attribute {attribute!r}")
    message = not_provided(f"{module_name}.{attribute}")
    try:
        caller = sys._getframe(2).f_code.co_name
    except ValueError:  # called from the outermost frame
        caller = ""
    if caller == "_handle_fromlist":
        return ImportError(message, name=module_name)
    return AttributeError(message)
