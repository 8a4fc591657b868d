"""Docs that run (issue 47): the marked shell and Python blocks of Get started are run as pasted,
in a fresh folder with a fresh home (so a fresh ~/.mserve), against the real server they start,
twice, as a newcomer would paste them again. The test's server takes free ports: the pages'
127.0.0.1:8080 (and the other default ports) are rewritten to them, and the server reads the
same through its MSERVE_* variables."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from runnable import as_script, marked_blocks

ROOT = Path(__file__).resolve().parent.parent.parent
# the docs' default port of each listener -> the setting that moves it
PORTS = {
    8080: "INFERENCE_ADDRESS",
    8081: "MANAGEMENT_ADDRESS",
    8082: "METRICS_ADDRESS",
    7070: "GRPC_INFERENCE_ADDRESS",
    7071: "GRPC_MANAGEMENT_ADDRESS",
}


_CACHES = shutil.ignore_patterns("__pycache__")
EXAMPLES = sorted(
    p.parent for p in (ROOT / "examples").glob("*/README.md") if marked_blocks(p)
)  # fmt: skip


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _run_page(page: Path, tmp_path: Path, example: Path | None = None) -> str:
    """``example``: an example's folder, copied to examples/<name> of the fresh folder, for
    READMEs that run from the repository root."""
    blocks = marked_blocks(page)
    assert blocks, f"{page} has no <!-- run --> blocks"
    ours = dict(zip(PORTS, _free_ports(len(PORTS)), strict=True))
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    if example is not None:
        shutil.copytree(example, work / "examples" / example.name, ignore=_CACHES)
    env = {
        **os.environ,
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        **{f"MSERVE_{key}": f"127.0.0.1:{ours[port]}" for port, key in PORTS.items()},
    }
    script = as_script(blocks, ours)
    try:
        for attempt in (1, 2):
            done = subprocess.run(
                ["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True,
                timeout=150,
            )  # fmt: skip
            assert done.returncode == 0, (
                f"{page.name}, run {attempt}: exit {done.returncode}\n{done.stdout[-3000:]}\n"
                f"{done.stderr[-3000:]}"
            )
    finally:
        subprocess.run(["mserve", "--stop"], env=env, capture_output=True, timeout=60)
    return done.stdout


# each run imports torch three or four times (weights, archive, worker): ~15-40 s a run
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_get_started_runs_as_pasted_twice(tmp_path: Path) -> None:
    out = _run_page(ROOT / "docs" / "get-started.md", tmp_path)
    assert '"probabilities"' in out  # curl's answer
    assert "BadInput" in out and "(HTTP 400)" in out  # the mistake, named
    assert "stopped" in out.lower()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_readme_five_minute_example_runs_as_pasted_twice(tmp_path: Path) -> None:
    out = _run_page(ROOT / "README.md", tmp_path)
    assert '"score"' in out


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_readme_runs_as_pasted_twice(example: Path, tmp_path: Path) -> None:
    """Each example README's marked blocks, from a fresh folder holding the example where the
    repository has it (the READMEs run from the repository root)."""
    _run_page(example / "README.md", tmp_path, example=example)


def test_the_examples_with_marked_blocks() -> None:
    """The examples whose READMEs are run; one to add is one marked block away."""
    assert [p.name for p in EXAMPLES] == ["mlp"]
