"""Which installed packages a loaded handler pulled in: what the worker template should preload.

A worker reports them in its READY frame; the server remembers them per environment and the
template of that environment imports exactly those, so a worker of an echo handler never carries
torch and one of a torch model is forked with torch already imported. Only packages installed
in the environment count: the standard library costs little to import, and the model's own
modules (its folder) and ours are no business of a template shared by every model of the
environment. Standard library only.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig

# A name the template will import: dotted identifiers, nothing else (it came from a worker).
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
MAX_MODULES = 256
MAX_NAME_CHARS = 200
_SITE_DIRS = ("site-packages", "dist-packages")


def _file_of(module: object) -> str | None:
    path = getattr(module, "__file__", None)
    return os.path.realpath(path) if isinstance(path, str) else None


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _is_stdlib(path: str, stdlib_dirs: list[str]) -> bool:
    if any(part in _SITE_DIRS for part in path.split(os.sep)):
        return False
    return any(_under(path, folder) for folder in stdlib_dirs)


def loaded_packages(exclude_dirs: list[str], before: set[str] | frozenset[str] = frozenset()
                    ) -> list[str]:  # fmt: skip
    """The shortest importable names covering every installed (non-stdlib) module imported
    since ``sys.modules`` held the names ``before``, leaving out modules that live under
    ``exclude_dirs`` (the model's folder, the runtime).

    The shortest name with a file of its own: ``torch`` for ``torch.nn``, but
    ``google.protobuf`` for a namespace package ``google`` (importing ``google`` alone would
    import nothing)."""
    stdlib_dirs = [
        os.path.realpath(p)
        for p in {sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")}
        if p
    ]
    excluded = [os.path.realpath(d) for d in exclude_dirs]
    stdlib_names = getattr(sys, "stdlib_module_names", frozenset())  # 3.10+; else by path
    decided: dict[str, bool] = {}  # shortest prefix with a file -> whether it counts
    for name in list(sys.modules):
        top = name.partition(".")[0]
        if top in decided or top in stdlib_names or name in before:
            continue  # the common case, without any path work
        parts = name.split(".")
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            if prefix in decided or prefix in before:
                break
            path = _file_of(sys.modules.get(prefix))
            if path is not None:
                decided[prefix] = not _is_stdlib(path, stdlib_dirs) and not any(
                    _under(path, folder) for folder in excluded
                )
                break
    found = [prefix for prefix, counts in decided.items() if counts]
    names = sorted(
        n for n in found
        if MODULE_NAME.match(n) and len(n) <= MAX_NAME_CHARS and not n.startswith("__")
    )  # fmt: skip
    # a package already covers its submodules: keep the outermost names only
    names = [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]
    return names[:MAX_MODULES]


def valid_names(value: object) -> list[str]:
    """``value`` as a list of module names to preload; ValueError naming the bad entry."""
    if not isinstance(value, list):
        raise ValueError(f"expected a list of module names, got {type(value).__name__}")
    if len(value) > MAX_MODULES:
        raise ValueError(f"{len(value)} module names, at most {MAX_MODULES} allowed")
    for name in value:
        if not isinstance(name, str) or len(name) > MAX_NAME_CHARS or not MODULE_NAME.match(name):
            raise ValueError(f"not a module name: {name!r}")
    return list(value)
