"""Parse the ``--handler`` value in every form TorchServe and MMS users type.

Forms: ``module``, ``module:function``, ``path/to/file.py[:function]`` and dotted
``pkg.module:callable``. A path is packed into the archive root (as torch-model-archiver does);
a module name must be found among the packed files, next to the caller, or be importable in the
model's environment (a built-in handler or one installed from requirements).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from archiver.errors import InputNotFound, UsageError

# Handlers the server ships; naming one needs no file in the archive. The server's list is
# mserve_worker.sdk.BUILTIN_HANDLERS (the archiver never imports the server; a test compares).
BUILTIN_HANDLERS = frozenset(
    {"image_classifier", "image_segmenter", "object_detector", "text_classifier"}
)
# Values of --handler-style besides "auto"; the worker's list is mserve_worker.contract.STYLES.
HANDLER_STYLES = ("module-function", "handler-class", "kernel", "hooks", "v2-model")


@dataclass(frozen=True)
class HandlerSpec:
    """A parsed ``--handler``: the module to import, the optional callable, and a file to pack."""

    module: str
    function: str | None
    source_file: Path | None

    @property
    def manifest_value(self) -> str:
        """The manifest's ``handler``, as torch-model-archiver writes it for the same intent.

        A packed file is ``h.py`` alone and ``h:fn`` with a function; a module stays as typed.
        """
        if self.source_file is not None and not self.function:
            return self.source_file.name
        return f"{self.module}:{self.function}" if self.function else self.module

    @property
    def module_paths(self) -> tuple[str, str]:
        """Archive paths where the module may live: ``pkg/mod.py`` or ``pkg/mod/__init__.py``."""
        rel = self.module.replace(".", "/")
        return (f"{rel}.py", f"{rel}/__init__.py")


def _looks_like_path(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or "\\" in module_part


def parse_handler(spec: str, *, base_dir: Path | None = None) -> HandlerSpec:
    """Parse ``spec``; raise ``UsageError`` naming what is wrong with it and the accepted forms."""
    forms = "use module, module:function, path/to/file.py[:function] or pkg.module:Callable"
    text = spec.strip()
    if not text:
        raise UsageError("--handler is empty", hint=forms)
    if text.count(":") > 1:
        raise UsageError(f"--handler {spec!r} has more than one ':'", hint=forms)
    module_part, _, function = text.partition(":")
    if ":" in text and not function:
        raise UsageError(f"--handler {spec!r} has nothing after ':'", hint=forms)
    if function and not function.isidentifier():
        raise UsageError(
            f"--handler {spec!r}: {function!r} is not a valid Python name for the entry point",
            hint=forms,
        )
    if not module_part:
        raise UsageError(f"--handler {spec!r} names no module before ':'", hint=forms)

    if _looks_like_path(module_part):
        path = Path(module_part)
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        if not path.is_file():
            raise InputNotFound("handler file", module_part)
        if path.suffix != ".py":
            raise UsageError(
                f"--handler {spec!r}: {path.name!r} is not a Python file (.py)", hint=forms
            )
        if not path.stem.isidentifier():
            raise UsageError(
                f"--handler {spec!r}: {path.stem!r} cannot be imported as a Python module name",
                hint="rename the file to letters, digits and '_' only",
            )
        return HandlerSpec(module=path.stem, function=function or None, source_file=path)

    if not all(part.isidentifier() for part in module_part.split(".")):
        raise UsageError(f"--handler {spec!r}: {module_part!r} is not a module name", hint=forms)
    return HandlerSpec(module=module_part, function=function or None, source_file=None)
