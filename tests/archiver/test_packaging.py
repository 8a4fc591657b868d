"""The built wheel ships the manifest schema, and the installed package finds it."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_wheel_ships_schema_and_installed_package_uses_it(tmp_path: Path) -> None:
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--quiet",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("mserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert "archiver/manifest_schema.json" in names
    assert any(n.endswith("entry_points.txt") for n in names)

    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
    # Run from an unrelated folder with the unpacked wheel first on the path: the source
    # checkout's copy of the schema is out of reach, so only the packaged one can be found.
    code = (
        "import archiver, archiver.manifest as m, json, sys\n"
        "assert archiver.__file__.startswith(sys.argv[1]), archiver.__file__\n"
        "man = m.parse(json.dumps({'model': {'modelName': 'x', 'handler': 'h'}}).encode(), 't')\n"
        "print(m.schema()['title'], man.model.model_version)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", code, str(target)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "MAR-INF/MANIFEST.json 1.0"
