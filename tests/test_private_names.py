"""The worker runtime's private names stay private: the server and the archiver use what
``mserve_worker`` makes public, never a ``_name`` of it, so the worker can change its insides
without breaking the server it runs under. (import-linter checks modules, not names: the import
contracts in pyproject.toml hold the rest of the layering.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = "mserve_worker"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) of every private name of the worker runtime this module's code reaches:
    ``from mserve_worker.x import _y``, ``import mserve_worker._x``, and ``alias._y`` where
    ``alias`` is a worker module it imported."""
    tree = ast.parse(source)
    modules: set[str] = set()  # local names bound to a worker module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != WORKER:
                continue
            if any(_private(part) for part in node.module.split(".")):
                found.append((node.lineno, f"from {node.module} import ..."))
            for alias in node.names:
                if _private(alias.name):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
                else:  # may be a submodule: its attributes are checked below
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != WORKER:
                    continue
                if any(_private(part) for part in alias.name.split(".")):
                    found.append((node.lineno, f"import {alias.name}"))
                modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            dotted = []
            while isinstance(base, ast.Attribute):
                dotted.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                path = ".".join([base.id, *reversed(dotted), node.attr])
                found.append((node.lineno, path))
    return sorted(found)


def test_the_check_finds_each_form() -> None:
    source = (
        "from mserve_worker.payload import _is_json, decode_request\n"
        "import mserve_worker.framing as framing\n"
        "from mserve_worker import protocol\n"
        "x = framing._HEADER\n"
        "y = protocol.Frame.__name__\n"
        "z = protocol._private_helper()\n"
        "from server.errors import _not_the_worker\n"
    )
    assert private_uses(source) == [
        (1, "from mserve_worker.payload import _is_json"),
        (4, "framing._HEADER"),
        (6, "protocol._private_helper"),
    ]


def test_server_and_archiver_use_only_public_worker_names() -> None:
    offences = []
    for package in ("server", "archiver"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "protos" in path.parts:  # generated
                continue
            for line, what in private_uses(path.read_text(encoding="utf-8")):
                offences.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not offences, "private names of mserve_worker used outside it:\n" + "\n".join(offences)
