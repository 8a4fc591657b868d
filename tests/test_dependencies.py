"""pyproject.toml says what the server and the archiver import, no more and no less: every
package their code imports is declared by name (in the dependencies, or in the extra whose
feature imports it), every runtime dependency is imported by that code, and the ``test`` extra
does not repeat what the extras it pulls in already declare.

The worker runtime (mserve_worker/) is not checked here: it runs in each model's own
environment, stdlib only, and what its SDK's handlers import is the model's requirement."""

from __future__ import annotations

import ast
import functools
import re
import sys
from importlib import metadata
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter brings tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
OURS = {"server", "archiver", "mserve_worker", "ts"}
# imported but not declared by us, with the reason
UNDECLARED = {
    # server/rayserve/ingress.py runs inside Ray Serve, whose own HTTP stack it uses: the ray
    # extra's ray[serve] brings the starlette that Ray works with; a pin of ours could only
    # fight Ray's
    "starlette": "ray",
}


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _imports(package: str) -> dict[str, str]:
    """Dotted module name -> the first file importing it, for every import of ``package``'s
    code (lazy ones included) of something neither ours nor the standard library's."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in OURS and top not in sys.stdlib_module_names:
                    found.setdefault(name, str(path.relative_to(ROOT)))
    return found


@functools.cache
def _providers() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def _distribution(module: str) -> str:
    """The installed distribution that provides ``module`` (for a namespace such as
    ``google`` or ``opentelemetry``, the one holding its first two parts)."""
    top = module.split(".")[0]
    candidates = _providers().get(top, [])
    if len(candidates) > 1:
        prefix = "/".join(module.split(".")[:2])
        holding = [
            d
            for d in candidates
            if any(str(f).startswith(prefix) for f in metadata.distribution(d).files or ())
        ]
        candidates = holding or candidates
    assert len(set(candidates)) == 1, f"cannot tell which distribution provides {module}"
    return candidates[0].lower().replace("_", "-")


def test_every_import_is_declared_and_every_dependency_imported() -> None:
    project = _project()
    runtime = {_name(r) for r in project["dependencies"]}
    extras = {k: {_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    declared = runtime.union(*(v for k, v in extras.items() if k != "test"))
    imported: dict[str, str] = {}
    for package in ("server", "archiver"):
        for module, where in _imports(package).items():
            imported.setdefault(_distribution(module), f"{where} imports {module}")
    undeclared = {
        d: why for d, why in imported.items() if d not in declared and d not in UNDECLARED
    }
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    unused = sorted(runtime - set(imported))
    assert not unused, (
        f"runtime dependencies that no code of server/ or archiver/ imports: {unused}"
    )


def test_the_test_extra_repeats_nothing_it_already_gets() -> None:
    project = _project()
    extras = {k: [_name(r) for r in v] for k, v in project["optional-dependencies"].items()}
    pulled = set(_name(r) for r in project["dependencies"])
    for requirement in project["optional-dependencies"]["test"]:
        if _name(requirement) == "mserve":  # mserve[otel,...]: the extras it pulls in
            for extra in re.findall(r"\[(.*)\]", requirement)[0].split(","):
                pulled.update(extras[extra.strip()])
    own = [d for d in extras["test"] if d != "mserve"]
    repeated = sorted(set(own) & pulled)
    assert not repeated, f"the test extra repeats what it already gets: {repeated}"
    assert len(own) == len(set(own)), "the test extra names a package twice"
