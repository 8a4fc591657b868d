"""The marked blocks of a Markdown page as one bash script, and a runner for it.

A fenced block right after a ``<!-- run -->`` line runs; ``bash`` blocks as they are, ``python``
blocks through ``python -``, in the page's order, in one shell (so a ``cd`` or a variable carries
on, as in a reader's terminal). ``run_page`` runs them in a fresh folder with a fresh home (so a
fresh ~/.mserve), against the real server the page starts: the pages' 127.0.0.1:8080 (and the
other default ports) are rewritten to free ports, and the server reads the same through its
MSERVE_* variables. The test files: test_runnable_docs.py (Get started, the README) and
test_runnable_examples*.py (each example's README, split so that xdist runs them side by side).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
_BLOCK = re.compile(r"^<!-- run -->\n```(bash|python)\n(.*?)^```$", re.S | re.M)
# the docs' default port of each listener -> the setting that moves it
PORTS = {
    8080: "INFERENCE_ADDRESS",
    8081: "MANAGEMENT_ADDRESS",
    8082: "METRICS_ADDRESS",
    7070: "GRPC_INFERENCE_ADDRESS",
    7071: "GRPC_MANAGEMENT_ADDRESS",
}
_CACHES = shutil.ignore_patterns("__pycache__")
# The examples whose READMEs run, in two test files that xdist (--dist loadfile) runs side by
# side, about the same time each: test_runnable_examples.py, test_runnable_examples_2.py
EXAMPLE_SPLIT = (
    ("image_classifier", "kernel", "mlp", "v2_model"),
    ("hooks", "tiny_lm", "waveglow"),
)


def marked_blocks(page: Path) -> list[tuple[str, str]]:
    """(language, code) of every marked block."""
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(page.read_text(encoding="utf-8"))]


def as_script(blocks: list[tuple[str, str]], ports: dict[int, int]) -> str:
    """One bash script; ``ports``: the pages' default ports -> the ones the test's server took."""
    parts = ["set -euo pipefail"]
    for language, code in blocks:
        if language == "python":
            code = f"python - <<'MSERVE_DOCS_PY'\n{code}MSERVE_DOCS_PY\n"
        for theirs, ours in ports.items():
            code = code.replace(f"127.0.0.1:{theirs}", f"127.0.0.1:{ours}")
        parts.append(code)
    return "\n".join(parts)


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def run_page(
    page: Path, tmp_path: Path, example: Path | None = None, times: int = 1, timeout_s: int = 150
) -> str:
    """Run the page's marked blocks ``times`` times in one fresh folder; the last run's stdout.
    ``example``: an example's folder, copied to examples/<name> of the fresh folder, for READMEs
    that run from the repository root."""
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
        for attempt in range(1, times + 1):
            done = subprocess.run(
                ["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True,
                timeout=timeout_s,
            )  # fmt: skip
            assert done.returncode == 0, (
                f"{page.name}, run {attempt}: exit {done.returncode}\n{done.stdout[-3000:]}\n"
                f"{done.stderr[-3000:]}"
            )
    finally:
        subprocess.run(["mserve", "--stop"], env=env, capture_output=True, timeout=60)
    return done.stdout


def rerun_problems(page: Path) -> list[str]:
    """What would make the page's marked blocks fail when pasted a second time, read from the
    script (milliseconds, where running it twice costs a server start and torch imports): an
    archive written without ``--force``, a ``mkdir`` without ``-p``, a server started and not
    stopped at the end. The README and Get started are also run twice for real."""
    script = as_script(marked_blocks(page), {})
    commands = re.sub(r"\\\n\s*", " ", script).splitlines()  # continuation lines joined
    problems = []
    for line in commands:
        words = line.split()
        archives = words[:1] == ["model-archiver"] and "--inspect" not in words
        if archives and not {"--force", "-f"} & set(words):
            problems.append(f"model-archiver without --force: {' '.join(words)}")
        if words[:1] == ["mkdir"] and "-p" not in words:
            problems.append(f"mkdir without -p: {' '.join(words)}")
    starts = [i for i, line in enumerate(commands) if line.startswith("mserve --start")]
    stops = [i for i, line in enumerate(commands) if line.startswith("mserve --stop")]
    if starts and (not stops or stops[-1] < starts[-1]):
        problems.append("the server it starts is not stopped at the end (mserve --stop)")
    return problems
