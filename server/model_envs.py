"""Per-model Python environments: built once per key, cached, shared, never half-used.

Key: interpreter, normalised requirements, options (isolated, wheelhouse contents), installer
and the worker runtime's version. Build: under a per-key file lock, in a temp folder next to the
cache entry (debris of killed builds is swept first), probe-import the runtime, write metadata
last, then rename into place; an entry without metadata is never used.

Default environments see the server's own packages *behind* their own (a ``.pth`` that appends
the server's site-packages), so a 2 GB torch is not reinstalled per model while the model's pins
win; ``isolated`` ones do not. Either way the worker runtime is importable through a ``.pth`` to
a folder that holds only the stdlib-only runtime, not the server and its dependencies.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import site
import subprocess
import sys
import sysconfig
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from archiver import __version__
from server import locks
from server.errors import InvalidModel
from server.rundir import ENV_META_FILE as META_FILE
from server.weights import sbom

log = logging.getLogger(__name__)

SCHEMA = 1
TAIL_LINES = 25
# The in-worker package, whole: everything under it runs inside model environments.
RUNTIME_PACKAGE = "mserve_worker"
RUNTIME_DIR = Path(__file__).resolve().parent.parent / RUNTIME_PACKAGE


def _child_side_files() -> list[Path]:
    """The in-worker package's files, relative to its parent folder."""
    return [f.relative_to(RUNTIME_DIR.parent) for f in sorted(RUNTIME_DIR.rglob("*.py"))]


@functools.cache
def runtime_digest() -> str:
    """Hash of the worker-side code, so a changed runtime never reuses a stale copy."""
    digest = hashlib.sha256()
    for rel in _child_side_files():
        digest.update(str(rel).encode() + b"\0" + (RUNTIME_DIR.parent / rel).read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def copy_runtime(root: Path) -> None:
    """Lay out only the in-worker package under ``root``, importable as ``mserve_worker``."""
    for rel in _child_side_files():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(RUNTIME_DIR.parent / rel, target)


@dataclass(frozen=True)
class EnvRequest:
    requirements: str
    model_label: str
    wheelhouse: Path | None = None
    isolated: bool = False


class EnvBuildError(InvalidModel):
    """The installer failed; the message carries its last lines."""


def normalise_requirements(text: str) -> str:
    """Comments, blank lines and order do not change what gets installed."""
    lines = []
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            lines.append(re.sub(r"\s+", " ", line))
    return "\n".join(sorted(lines))


def find_uv() -> str | None:
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def _installer_version(uv: str | None) -> str:
    if uv is None:
        return "pip"
    out = subprocess.run([uv, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.strip() or "uv"


def _wheelhouse_digest(folder: Path | None) -> str:
    if folder is None:
        return ""
    entries = sorted((p.name, p.stat().st_size) for p in folder.iterdir() if p.is_file())
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def protected_constraints(names: tuple[str, ...]) -> list[str]:
    """Exact versions of the protected base packages and everything they need, as installer
    constraints: a model pin that would break them (say typing-extensions==4.5.0 under torch)
    is refused at install time, while pins of unrelated packages still install."""
    from importlib import metadata

    pins: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in pins:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        pins[key] = f"{dist.metadata['Name']}=={dist.version}"
        for req in dist.requires or []:
            if "extra ==" in req.replace('"', "").replace("'", ""):
                continue  # optional extras are not part of what the base needs
            match = _NAME.match(req)
            if match:
                todo.append(match.group(1))
    return sorted(pins.values())


def _base_site_packages() -> list[str]:
    """Where the server's own packages live (a venv's, not the base interpreter's)."""
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    paths += site.getsitepackages()
    seen: list[str] = []
    for p in paths:
        if p not in seen and Path(p).is_dir():
            seen.append(p)
    return seen


class BuildConfinement(Protocol):
    """How a build's commands are confined (``server/workers/build_sandbox.py``): a build runs
    code of the model's requirements (``setup.py``, build backends, ``.pth`` files)."""

    environ: Mapping[str, str]  # what the build's processes get of the server's environment

    def prefix(self, folder: Path, reads: list[Path], requirements: str, offline: bool
               ) -> list[str]: ...  # fmt: skip

    def done(self, folder: Path) -> None: ...


class EnvCache:
    def __init__(
        self,
        root: Path,
        python: str = sys.executable,
        use_uv: bool = True,
        protected: tuple[str, ...] = ("torch",),
        sandbox: BuildConfinement | None = None,
    ) -> None:
        """``sandbox``: how builds are confined (None: they run as the server does)."""
        self.root = root
        self.python = python
        self.protected = protected
        self.uv = find_uv() if use_uv else None
        self.sandbox = sandbox

    @functools.cached_property
    def _installer(self) -> str:
        """Asked of the installer on first use, not at server start (it costs a process)."""
        return _installer_version(self.uv)

    # --- keys and paths ---------------------------------------------------------------------

    def key(self, request: EnvRequest) -> str:
        identity = {
            "schema": SCHEMA,
            "python": os.path.realpath(self.python),
            "python_version": sys.version,
            "requirements": normalise_requirements(request.requirements),
            "isolated": request.isolated,
            "wheelhouse": _wheelhouse_digest(request.wheelhouse),
            "installer": self._installer,
            "runtime": f"{__version__}-{runtime_digest()}",
            "base": [] if request.isolated else _base_site_packages(),
            "constraints": [] if request.isolated else protected_constraints(self.protected),
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]

    def path(self, key: str) -> Path:
        return self.root / key

    def env_python(self, key: str) -> str:
        return str(self.path(key) / "bin" / "python")

    def ready(self, key: str) -> bool:
        return (self.path(key) / META_FILE).is_file()

    def runtime_dir(self) -> Path:
        """A folder with only the stdlib worker runtime, importable as ``mserve_worker``."""
        folder = self.root / f"runtime-{__version__}-{runtime_digest()}"
        if not (folder / RUNTIME_PACKAGE / "runtime.py").is_file():
            tmp = self.root / f".tmp-runtime-{os.getpid()}-{secrets.token_hex(4)}"
            copy_runtime(tmp)
            try:
                os.rename(tmp, folder)
            except OSError:  # another process won the race; theirs is identical
                shutil.rmtree(tmp, ignore_errors=True)
        return folder

    # --- building ---------------------------------------------------------------------------

    def ensure(self, request: EnvRequest, on_line: Callable[[str], None] | None = None) -> str:
        """The environment's python, building it if needed (blocking: run in a thread)."""
        self.root.mkdir(parents=True, exist_ok=True)
        key = self.key(request)
        if self.ready(key):
            return self.env_python(key)

        def waiting() -> None:
            log.info("environment %s: another process is building it; waiting for it", key)

        with locks.exclusive(self.root / f".{key}.lock", waiting):
            if self.ready(key):  # another process built it while we waited
                return self.env_python(key)
            for debris in self.root.glob(f".tmp-{key}-*"):
                shutil.rmtree(debris, ignore_errors=True)  # a killed build; safe under the lock
            tmp = self.root / f".tmp-{key}-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                started = time.monotonic()
                self._build(tmp, request, on_line or (lambda line: None))
                meta = {
                    "key": key,
                    "created": time.time(),
                    "build_s": round(time.monotonic() - started, 3),
                    "requirements": normalise_requirements(request.requirements),
                    "isolated": request.isolated,
                    "installer": self._installer,
                    "first_model": request.model_label,
                }
                (tmp / META_FILE).write_text(json.dumps(meta, indent=2))  # written last
                os.rename(tmp, self.path(key))
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            log.info("environment %s for %s built in %.2f s", key[:12], request.model_label,
                     meta["build_s"])  # fmt: skip
        return self.env_python(key)

    def _environ(self) -> dict[str, str]:
        base = self.sandbox.environ if self.sandbox is not None else os.environ
        return {**base, "UV_COMPILE_BYTECODE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    def _run(self, cmd: list[str], what: str, on_line: Callable[[str], None], label: str) -> None:
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        env = self._environ()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            log.info("[%s] %s: %s", label, what, line)
            on_line(line)
        if proc.wait() != 0:
            raise EnvBuildError(
                f"{what} failed for {label} (exit code {proc.returncode}); installer output:\n"
                + "\n".join(tail)
            )

    def _build(self, tmp: Path, request: EnvRequest, on_line: Callable[[str], None]) -> None:
        try:
            self._build_in(tmp, request, on_line)
        finally:
            if self.sandbox is not None:
                self.sandbox.done(tmp)

    def _build_in(self, tmp: Path, request: EnvRequest, on_line: Callable[[str], None]) -> None:
        label = request.model_label
        confined: list[str] = []  # every command of the build runs confined
        if self.sandbox is not None:
            reads = [self.runtime_dir(), *([request.wheelhouse] if request.wheelhouse else [])]
            confined = self.sandbox.prefix(tmp, reads, request.requirements,
                                           offline=request.wheelhouse is not None)  # fmt: skip
        if self.uv:
            self._run([*confined, self.uv, "venv", "--quiet", "--relocatable",
                       *(["--allow-existing"] if confined else []), "--python", self.python,
                       str(tmp)], "creating the environment", on_line, label)  # fmt: skip
        else:
            self._run([*confined, self.python, "-m", "venv", str(tmp)],
                      "creating the environment", on_line, label)  # fmt: skip
        python = str(tmp / "bin" / "python")
        purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        site_dir = Path(
            subprocess.run([*confined, python, "-c", purelib], capture_output=True, text=True,
                           check=True, env=self._environ()).stdout.strip()
        )  # fmt: skip
        # .pth files run in name order: the runtime first, then (layered) the server's packages,
        # both after the environment's own site-packages, so the model's pins win.
        (site_dir / "00-mserve-runtime.pth").write_text(f"{self.runtime_dir()}\n")
        if not request.isolated:
            (site_dir / "zz-mserve-base.pth").write_text("\n".join(_base_site_packages()) + "\n")
        req_file = tmp / "requirements.txt"
        req_file.write_text(request.requirements)
        offline: list[str] = []
        if request.wheelhouse is not None:
            offline = ["--no-index", "--find-links", str(request.wheelhouse)]
        constraints: list[str] = []
        pins = [] if request.isolated else protected_constraints(self.protected)
        if pins:
            (tmp / "constraints.txt").write_text("\n".join(pins) + "\n")
            constraints = ["-c", str(tmp / "constraints.txt")]
        if self.uv:
            cmd = [self.uv, "pip", "install", "--python", python, "--compile-bytecode",
                   *(["--offline"] if offline else []), *offline, *constraints,
                   "-r", str(req_file)]  # fmt: skip
        else:
            cmd = [python, "-m", "pip", "install", *offline, *constraints, "-r", str(req_file)]
        self._run([*confined, *cmd], "installing requirements", on_line, label)
        probe = subprocess.run([*confined, python, "-I", "-c", "import mserve_worker.runtime"],
                               capture_output=True, text=True, env=self._environ())  # fmt: skip
        if probe.returncode != 0:
            raise EnvBuildError(f"the worker runtime does not import in the new environment for"
                                f" {label}: {probe.stderr.strip()[-500:]}")  # fmt: skip
        # what it holds, beside it (server/weights/sbom.py)
        sbom.record(python, tmp, label, confined, self._environ())

    def sbom(self, key: str, label: str) -> bytes:
        """The SBOM of environment ``key``: the one its build made, or one made now (the
        generator starts the environment's interpreter, which runs the ``.pth`` files of what
        it holds: confined as the build was)."""
        folder, confined = self.path(key), list[str]()
        if self.sandbox is not None and not (folder / sbom.SBOM_FILE).is_file():
            confined = self.sandbox.prefix(folder, [self.runtime_dir()], "", offline=True)
        return sbom.ensure(self.env_python(key), folder / sbom.SBOM_FILE, label, confined,
                           self._environ())  # fmt: skip

    # --- housekeeping -----------------------------------------------------------------------

    def entries(self) -> list[dict[str, object]]:
        out = []
        if not self.root.is_dir():
            return out
        for meta_file in sorted(self.root.glob(f"*/{META_FILE}")):
            meta = json.loads(meta_file.read_text())
            meta["size_bytes"] = _tree_size(meta_file.parent)
            out.append(meta)
        return out

    def prune(self, in_use: set[str]) -> list[str]:
        removed = []
        for meta in self.entries():
            key = str(meta["key"])
            if key in in_use:
                continue
            with locks.exclusive(self.root / f".{key}.lock"):
                trash = self.root / f".tmp-{key}-pruned-{secrets.token_hex(4)}"
                os.rename(self.path(key), trash)  # unusable at once, then removed
                shutil.rmtree(trash, ignore_errors=True)
            removed.append(key)
        return removed


def _tree_size(folder: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total
