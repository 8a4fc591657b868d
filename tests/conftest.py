"""Shared fixtures: a CLI runner for model-archiver and the real compatibility tools."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from archiver.cli import main as archiver_main
from tests.compat_tools import CompatTool, build_compat_tool

REPO = Path(__file__).resolve().parent.parent
# The installed console script, from the environment running the tests (PATH may not have it).
ARCHIVER_SCRIPT = str(Path(sys.executable).parent / "model-archiver")


def pytest_configure(config: pytest.Config) -> None:
    """As root, each session's temporary folders lie in a folder of its own: pytest makes its
    shared ``/tmp/pytest-of-root`` 0700 whenever a session starts, and a root server's
    workers run as their own uid (server/workers/sandbox_users.py), which must reach their run
    dir and what a test grants them through it, while other sessions start beside this one."""
    if config.option.basetemp is None and os.geteuid() == 0:
        config.option.basetemp = tempfile.mkdtemp(prefix="mserve-pytest-")
        config.stash[_OWN_BASETEMP] = config.option.basetemp


_OWN_BASETEMP = pytest.StashKey[str]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A passing session's folder goes; a failing one's stays for a look (its path is in the
    failures)."""
    own = session.config.stash.get(_OWN_BASETEMP, None)
    if own is not None and exitstatus == 0:
        shutil.rmtree(own, ignore_errors=True)


@pytest.fixture(scope="session")
def tma() -> CompatTool:
    """torch-model-archiver 0.12.0, installed for real (first run: a few seconds)."""
    return build_compat_tool("tma")


@pytest.fixture(scope="session")
def mms() -> CompatTool:
    """MMS model-archiver 1.0.3, installed for real."""
    return build_compat_tool("mms")


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
