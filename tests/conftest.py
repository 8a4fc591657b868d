"""Shared fixtures: a CLI runner for model-archiver and the real compatibility tools."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from archiver.cli import main as archiver_main

REPO = Path(__file__).resolve().parent.parent
# The installed console script, from the environment running the tests (PATH may not have it).
ARCHIVER_SCRIPT = str(Path(sys.executable).parent / "model-archiver")
COMPAT_DIR = REPO / ".cache" / "compat"

# The real tools we promise compatibility with, each in its own venv: both install a top-level
# package named `model_archiver`, so they cannot share one.
COMPAT_TOOLS = {
    "tma": ("torch-model-archiver==0.12.0", "torch-model-archiver"),
    "mms": ("model-archiver==1.0.3", "model-archiver"),
}


@dataclass(frozen=True)
class CompatTool:
    python: Path
    script: Path

    def run(self, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.script), *args], cwd=cwd, capture_output=True, text=True, timeout=120
        )

    def python_code(self, code: str, cwd: Path) -> str:
        out = subprocess.run(
            [str(self.python), "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return out.stdout


def _build_compat(name: str) -> CompatTool:
    """Install the tool once into .cache/compat; ``.complete`` is written last, so a run that
    was killed halfway is rebuilt instead of trusted (venv scripts embed their path, so the
    venv is built where it stays)."""
    requirement, script = COMPAT_TOOLS[name]
    home = COMPAT_DIR / requirement.replace("==", "-")
    if not (home / ".complete").exists():
        shutil.rmtree(home, ignore_errors=True)
        venv.EnvBuilder(with_pip=True).create(home)
        subprocess.run(
            [str(home / "bin" / "python"), "-m", "pip", "install", "--quiet", requirement],
            check=True,
            timeout=600,
        )
        (home / ".complete").write_text(requirement)
    return CompatTool(python=home / "bin" / "python", script=home / "bin" / script)


@pytest.fixture(scope="session")
def tma() -> CompatTool:
    """torch-model-archiver 0.12.0, installed for real (first run: a few seconds)."""
    return _build_compat("tma")


@pytest.fixture(scope="session")
def mms() -> CompatTool:
    """MMS model-archiver 1.0.3, installed for real."""
    return _build_compat("mms")


ArchiverRunner = Callable[..., Result]


@pytest.fixture
def archiver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ArchiverRunner:
    """Run ``model-archiver`` in-process with ``tmp_path`` as the working folder."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()

    def run(*args: str) -> Result:
        return runner.invoke(archiver_main, list(args), catch_exceptions=False)

    return run


@pytest.fixture
def model_inputs(tmp_path: Path) -> Path:
    """A realistic set of inputs: weights, model file, handler, package folder, config, reqs."""
    (tmp_path / "weights.pt").write_bytes(os.urandom(200_000))
    (tmp_path / "model.py").write_text("class Net:\n    pass\n")
    (tmp_path / "handler.py").write_text("def handle(data, context):\n    return data\n")
    pkg = tmp_path / "src" / "mypkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    (pkg / "sub" / "vocab.txt").write_text("a\nb\n")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "junk.pyc").write_bytes(b"\0")
    (tmp_path / "labels.json").write_text('{"0": "cat"}')
    (tmp_path / "requirements.txt").write_text("requests>=2\n")
    (tmp_path / "config.yaml").write_text("minWorkers: 1\nbatchSize: 4\nhandler:\n  topk: 3\n")
    return tmp_path
