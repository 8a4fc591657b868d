"""Worker templates started before the server has even imported itself.

A template's imports (``import torch``: over a second) are on the path from ``mserve --start``
to a model's first answer. The server process starts the templates its startup models will
need first thing, from what their workers imported the last time (``server/workers/preload.py``),
and only then imports the rest of itself, sets up its listeners and unpacks the archives: all
of that overlaps the templates' imports. The launcher adopts them once its event loop runs.
Imports only what reading two small JSON files and starting processes need.
"""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote

from server.rundir import SNAPSHOT_FILE, StartupModel
from server.workers.env_vars import WorkerEnvironment
from server.workers.preload import PreloadMemory

if TYPE_CHECKING:
    from server.config import ServerConfig

TemplateKey = tuple[str, tuple[str, ...]]  # interpreter, modules it preloads


@dataclass
class EarlyTemplate:
    """A template process already started: the launcher's end of its control socket, the read
    end of its stderr pipe."""

    key: TemplateKey
    proc: subprocess.Popen[bytes]
    sock: socket.socket
    stderr_fd: int


def template_command(python: str, fd: int, preload: Iterable[str]) -> list[str]:
    return [python, "-I", "-u", "-m", "mserve_worker.template", "--fd", str(fd),
            "--preload", ",".join(preload)]  # fmt: skip


def template_env(base_env: Mapping[str, str]) -> dict[str, str]:
    """No GPU for a template: a preload that touches CUDA cannot take a device (its children
    set their own CUDA_VISIBLE_DEVICES before they load anything)."""
    return {**base_env, "CUDA_VISIBLE_DEVICES": ""}


def snapshot_model_names(path: Path) -> list[str]:
    """The model names the snapshot holds, quietly (nothing when it is missing or unreadable:
    restoring it reports that)."""
    try:
        data = json.loads(path.read_text())
        return [str(m["name"]) for m in data.get("models", []) if isinstance(m, dict)]
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return []


def expected_models(urls: Iterable[tuple[str | None, str]], extra: Iterable[str]) -> list[str]:
    """Names of the models a start will load: each startup model's name, else its archive's
    file name (usually the model's), and ``extra`` (the snapshots' names)."""
    names = [name or Path(url.rstrip("/")).name.split(".")[0] for name, url in urls]
    return [*names, *extra]


GUESS_MAX_FILES = 32
GUESS_MAX_BYTES = 512 * 1024
_NOT_INSTALLED = {"mserve_worker", "ts", "__future__"}  # ours (the ts namespace), or no package


def guess_imports(model_dir: Path) -> list[str]:
    """At a model's first start, before any worker reported: the top-level packages its own
    ``.py`` files import at module level (``import torch``, ``from PIL import Image``), less
    the standard library and the model's own modules. A template started with them holds them
    when the first worker is forked, so a scale-up right after the first start forks too; what
    the worker then reports replaces the guess. A name that is not installed is skipped by the
    template."""
    try:
        files = sorted(model_dir.glob("*.py"))[:GUESS_MAX_FILES]
        own = {p.stem for p in model_dir.glob("*.py")} | {
            p.name for p in model_dir.iterdir() if p.is_dir()
        }
    except OSError:
        return []
    sources = []
    for path in files:
        try:
            if path.stat().st_size <= GUESS_MAX_BYTES:
                sources.append(path.read_bytes())
        except OSError:
            continue
    return _imported_packages(sources, own)


def _imported_packages(sources: Iterable[bytes], own: set[str]) -> list[str]:
    names: set[str] = set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        todo = list(tree.body)
        while todo:  # module level, and inside module-level if / try blocks
            node = todo.pop()
            if isinstance(node, ast.Import):
                names.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.partition(".")[0])
            elif isinstance(node, (ast.If, ast.Try)):
                todo += [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
                todo += [n for h in getattr(node, "handlers", []) for n in h.body]
    return sorted(
        n for n in names
        if n not in sys.stdlib_module_names and n not in own and n not in _NOT_INSTALLED
    )  # fmt: skip


MANIFEST_MEMBER = "MAR-INF/MANIFEST.json"  # archiver.MANIFEST_PATH, not imported this early


def guess_archive_imports(path: Path, per_model_envs: bool) -> list[str] | None:
    """:func:`guess_imports` for a startup model before its archive is unpacked: read from the
    ``.mar`` (zip) or archive folder at ``path``, so that its template imports them while the
    server imports itself and unpacks. None when it cannot tell: not a zip or folder (a
    ``.tar.gz`` is guessed once unpacked), unreadable, or a model whose workers may run in an
    environment of their own (``requirementsFile`` while ``per_model_envs``), whose interpreter
    is known only once that environment is built. The unpacking that follows checks the
    archive and reports what is wrong with it."""
    if path.is_dir():
        if per_model_envs and _needs_own_env((path / MANIFEST_MEMBER).read_bytes):
            return None
        return guess_imports(path)
    try:
        with zipfile.ZipFile(path) as archive:
            members = {info.filename: info for info in archive.infolist()}
            manifest = members.get(MANIFEST_MEMBER)
            if manifest is None or manifest.file_size > GUESS_MAX_BYTES:
                return None
            if per_model_envs and _needs_own_env(lambda: archive.read(manifest)):
                return None
            top = sorted(n for n in members if "/" not in n and n.endswith(".py"))
            own = {n[:-3] for n in top} | {n.partition("/")[0] for n in members if "/" in n}
            sources = [
                archive.read(members[n])
                for n in top[:GUESS_MAX_FILES]
                if members[n].file_size <= GUESS_MAX_BYTES
            ]
    except (OSError, zipfile.BadZipFile, RuntimeError, NotImplementedError, ValueError):
        return None
    return _imported_packages(sources, own)


def _needs_own_env(read: Callable[[], bytes]) -> bool:
    """Whether the manifest names a requirements file (unreadable: assume it does)."""
    try:
        model = json.loads(read()).get("model") or {}
        return bool(model.get("requirementsFile"))
    except (OSError, ValueError, AttributeError, KeyError, zipfile.BadZipFile):
        return True


def local_archive(url: str, store: Path | None) -> Path | None:
    """The file or folder a startup model's ``url`` names, if local (a name in the model store,
    a path, a ``file://`` URL), for :func:`guess_archive_imports` only: the registration
    resolves and checks it (server/store.py)."""
    scheme, sep, rest = url.partition("://")
    if sep:
        if scheme.lower() != "file":
            return None
        url = unquote(rest.removeprefix("localhost"))
    path = Path(url).expanduser()
    if not path.is_absolute():
        if store is None:
            return None
        path = store / path
    return path


def key_for(
    memory: PreloadMemory, python: str, model: str, preload: Iterable[str],
    guess: Iterable[str] = (),
) -> TemplateKey:  # fmt: skip
    """The template a model's workers are forked from: what they were seen to import, plus
    ``preload`` (``worker_preload``) and, at its first start, the ``guess`` from its source."""
    return python, tuple(sorted({*preload, *memory.modules(python, [model]), *guess}))


def template_keys(
    memory: PreloadMemory, models: list[str], preload: Iterable[str],
    guessed: Mapping[tuple[str, str], list[str]] | None = None,
) -> dict[tuple[str, str], TemplateKey]:  # fmt: skip
    """Which template each remembered (interpreter, model) of ``models`` needs, and each
    ``guessed`` one (:func:`guess_startup`)."""
    keys = {
        (python, model): key_for(memory, python, model, preload)
        for python, names in memory.pythons_for(models).items()
        for model in names
    }
    for (python, model), guess in (guessed or {}).items():
        keys[(python, model)] = key_for(memory, python, model, preload, guess)
    return keys


def spawn(keys: Iterable[TemplateKey], base_env: Mapping[str, str]) -> list[EarlyTemplate]:
    """Start one template per key whose interpreter exists; one that cannot start is left to
    the launcher, which tries again and reports the error."""
    started = []
    for key in dict.fromkeys(keys):
        python, preload = key
        if not os.path.exists(python):
            continue
        parent, child = socket.socketpair()
        err_r, err_w = os.pipe()
        try:
            proc = subprocess.Popen(
                template_command(python, child.fileno(), preload),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err_w,
                pass_fds=(child.fileno(),), start_new_session=True, env=template_env(base_env),
            )  # fmt: skip
        except OSError:
            parent.close()
            os.close(err_r)
            continue
        finally:
            child.close()
            os.close(err_w)
        started.append(EarlyTemplate(key, proc, parent, err_r))
    return started


@dataclass
class EarlyStart:
    """What the server process worked out before importing the rest of itself."""

    models: list[str]  # names of the models this start will load
    memory: PreloadMemory
    templates: list[EarlyTemplate]
    # (python, model) -> the packages guessed from its archive, for the models this start
    # loads for the first time on that interpreter (nothing learned yet)
    guessed: dict[tuple[str, str], list[str]] = field(default_factory=dict)


def guess_startup(
    config: ServerConfig, startup: list[StartupModel], memory: PreloadMemory, python: str
) -> dict[tuple[str, str], list[str]]:
    """What each startup model that ``python`` has never served imports, guessed from its
    archive (:func:`guess_archive_imports`): a fresh run dir (a new machine, a new pod) then
    starts its template at once too, instead of once the archive is unpacked and registered."""
    guessed = {}
    names = expected_models([(m.name, m.url) for m in startup], [])
    for model, name in zip(startup, names, strict=True):
        if memory.knows(python, name):
            continue
        path = local_archive(model.url, config.store_path)
        guess = None
        if path is not None:
            guess = guess_archive_imports(path, config.install_py_dep_per_model)
        if guess is not None:
            guessed[(python, name)] = guess
    return guessed


def start_early(config: ServerConfig, startup: list[StartupModel]) -> EarlyStart:
    """Start the templates this start's models will need; first thing in the server process."""
    snapshot = snapshot_model_names(config.run_path / SNAPSHOT_FILE) if config.snapshot else []
    models = expected_models(
        [(m.name, m.url) for m in startup],
        [*(e.name for e in config.model_snapshot or ()), *snapshot],
    )
    memory = PreloadMemory(config.env_path)
    if not config.fork_workers:
        return EarlyStart(models, memory, [])
    base = WorkerEnvironment.split(
        os.environ, config.worker_env_deny, config.worker_env_deny_regex
    ).base
    guessed = guess_startup(config, startup, memory, sys.executable)
    keys = template_keys(memory, models, config.worker_preload, guessed).values()
    return EarlyStart(models, memory, spawn(keys, base), guessed)
