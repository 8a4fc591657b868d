"""What ``model-archiver`` can check before it writes anything, all at once: every input that is
missing is reported in one error (three mistakes, one round trip), and a handler's entry point is
checked by reading its file without importing it (importing would run the model's code, and
need its dependencies, on the machine that only packs it), with "did you mean" for a misspelt
function or built-in handler name."""

from __future__ import annotations

import ast
import difflib
from pathlib import Path

from archiver.errors import ArchiverError, ExportPathMissing, InputNotFound, UsageError
from archiver.handler_spec import BUILTIN_HANDLERS, HandlerSpec


class InputProblems(ArchiverError):
    """Several inputs are wrong at once: each is listed, on a line of its own."""

    code = "input_problems"

    def __init__(self, problems: list[ArchiverError]) -> None:
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{len(problems)} problems with the inputs, nothing written:\n{lines}")
        self.problems = problems
        self.exit_code = problems[0].exit_code


def missing_inputs(
    export_path: str, files: dict[str, str | None], handler: str, model_path: str | None
) -> list[ArchiverError]:
    """Every input named on the command line that does not exist. ``files``: flag -> path."""
    problems: list[ArchiverError] = []
    for flag, value in files.items():
        if value and not Path(value).is_file():
            problems.append(InputNotFound(flag.replace("--", "").replace("-", " "), value))
    module_part = handler.strip().partition(":")[0]
    if (module_part.endswith(".py") or "/" in module_part) and not Path(module_part).is_file():
        problems.append(InputNotFound("handler file", module_part))
    if model_path and not Path(model_path).is_dir():
        problems.append(InputNotFound("--model-path folder", model_path))
    if not Path(export_path).is_dir():
        problems.append(ExportPathMissing(export_path))
    return problems


def _defined_names(tree: ast.Module) -> set[str] | None:
    """The module's top-level names; None when they cannot be known without running it (a
    ``from x import *`` or a module ``__getattr__``)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.If | ast.Try):  # a guarded definition: too dynamic to judge
            return None
    return names


def _did_you_mean(word: str, choices: set[str] | frozenset[str]) -> str | None:
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.75)
    return close[0] if close else None


def handler_problems(spec: HandlerSpec, handler: str, packed: set[str]) -> list[ArchiverError]:
    """A ``file.py:function`` whose file defines no such name (or does not parse), and a bare
    module name that is no packed file but is one letter off a built-in handler's name. A file
    that defines a class is left to the worker: TorchServe serves a module's one class when
    the name is not found.
    ``packed``: the archive's member names."""
    if spec.source_file is None:
        local = Path(spec.module_paths[0])
        if "." in spec.module or spec.module in BUILTIN_HANDLERS or local.is_file():
            return []
        if packed & set(spec.module_paths):
            return []
        close = _did_you_mean(spec.module, BUILTIN_HANDLERS)
        if close is None:
            return []
        return [
            UsageError(
                f"--handler {handler!r}: no built-in handler or file named {spec.module!r}",
                hint=f"did you mean {close!r}? (built-in: {', '.join(sorted(BUILTIN_HANDLERS))})",
            )
        ]
    path = spec.source_file
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as exc:
        return [
            UsageError(
                f"--handler {handler!r}: {path} is not valid Python (line {exc.lineno}: {exc.msg})",
                hint="fix the file: the server would fail to load it",
            )
        ]
    if not spec.function:
        return []
    names = _defined_names(tree)
    if names is None or spec.function in names:
        return []
    if any(isinstance(n, ast.ClassDef) for n in tree.body):
        return []  # TorchServe's fallback: a name not found serves the module's one class
    callables = {
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and not n.name.startswith("_")
    }
    close = _did_you_mean(spec.function, names)
    hint = f"did you mean {close!r}?" if close else None
    if hint is None:
        hint = f"it defines {', '.join(sorted(callables))}" if callables else "it defines none"
    return [
        UsageError(
            f"--handler {handler!r}: {path} has no function or class {spec.function!r}",
            hint=hint,
        )
    ]
