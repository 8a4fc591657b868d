"""The real tools we promise compatibility with, installed on first use into .cache/compat.

Used by the tests and by scripts/bench_archive.py. Each tool gets its own venv: both install a
top-level package named ``model_archiver``, so they cannot share one.
"""

from __future__ import annotations

import shutil
import subprocess
import venv
from dataclasses import dataclass
from pathlib import Path

from server.locks import exclusive

REPO = Path(__file__).resolve().parent.parent
COMPAT_DIR = REPO / ".cache" / "compat"

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


def build_compat_tool(name: str) -> CompatTool:
    """Install the tool once into .cache/compat; ``.complete`` is written last, so a run that
    was killed halfway is rebuilt instead of trusted (venv scripts embed their path, so the
    venv is built where it stays). The suite's parallel workers may ask at once: one builds
    under a lock while the others wait for it."""
    requirement, script = COMPAT_TOOLS[name]
    home = COMPAT_DIR / requirement.replace("==", "-")
    COMPAT_DIR.mkdir(parents=True, exist_ok=True)
    with exclusive(COMPAT_DIR / f".{name}.lock"):
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
