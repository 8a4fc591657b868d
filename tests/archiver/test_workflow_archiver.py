"""torch-workflow-archiver (our ``archiver.workflow_cli``): TorchServe's flags and .war layout,
and reading a .war back through the archive reader's checks."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from archiver.errors import InvalidManifest, UnsafeArchive
from archiver.workflow import open_workflow_archive
from archiver.workflow_cli import main

WAR = Path(__file__).resolve().parents[1] / "handlers" / "workflow" / "war"


def run(prog: str, *args: str) -> Result:
    return CliRunner().invoke(main, list(args), prog_name=prog)


def test_the_war_has_torchserves_layout(tmp_path: Path) -> None:
    (tmp_path / "labels.json").write_text("{}")
    result = run(
        "torch-workflow-archiver", "--workflow-name", "pipe", "--spec-file",
        str(WAR / "spec.yaml"), "--handler", str(WAR / "pipeline.py"), "--export-path",
        str(tmp_path), "--extra-files", str(tmp_path / "labels.json"),
    )  # fmt: skip
    assert (result.exit_code, result.output) == (0, "")  # silent, as TorchServe's
    with zipfile.ZipFile(tmp_path / "pipe.war") as zf:
        # every input flat at the top, the manifest under WAR-INF/ (TorchServe's WAR_INF)
        assert sorted(zf.namelist()) == [
            "WAR-INF/MANIFEST.json",
            "labels.json",
            "pipeline.py",
            "spec.yaml",
        ]
        manifest = json.loads(zf.read("WAR-INF/MANIFEST.json"))
        assert zf.read("spec.yaml") == (WAR / "spec.yaml").read_bytes()
    assert list(manifest) == ["createdOn", "workflow", "archiverVersion"]
    assert manifest["workflow"] == {
        "workflowName": "pipe",
        "specFile": "spec.yaml",
        "handler": "pipeline.py",
    }
    assert re.fullmatch(r"\d\d/\d\d/\d{4} \d\d:\d\d:\d\d", manifest["createdOn"])
    with open_workflow_archive(tmp_path / "pipe.war") as war:
        assert (war.manifest.workflow_name, war.manifest.spec_file) == ("pipe", "spec.yaml")
        war.extract(tmp_path / "out")
    assert (tmp_path / "out" / "pipeline.py").read_bytes() == (WAR / "pipeline.py").read_bytes()


def test_errors_name_the_problem_and_keep_the_existing_war(tmp_path: Path) -> None:
    args = ["--spec-file", str(WAR / "spec.yaml"), "--handler", str(WAR / "pipeline.py"),
            "--export-path", str(tmp_path)]  # fmt: skip
    assert run("workflow-archiver", "--workflow-name", "pipe", *args).output == (
        f"wrote {tmp_path / 'pipe.war'} ({(tmp_path / 'pipe.war').stat().st_size} bytes)\n"
    )
    before = (tmp_path / "pipe.war").read_bytes()
    again = run("torch-workflow-archiver", "--workflow-name", "pipe", *args)
    assert again.exit_code == 4
    assert again.output == (
        f"torch-workflow-archiver: error: output already exists: {tmp_path / 'pipe.war'};"
        " use -f/--force to overwrite, or another name\n"
    )
    assert (tmp_path / "pipe.war").read_bytes() == before
    bad = run("torch-workflow-archiver", "--workflow-name", "-pipe", *args)
    assert bad.exit_code == 2
    assert "workflow name '-pipe' has characters that are not allowed" in bad.output
    missing = run("workflow-archiver", "--workflow-name", "p", "--spec-file", "nope.yaml",
                  "--handler", str(WAR / "pipeline.py"), "--export-path", str(tmp_path))  # fmt: skip
    assert missing.exit_code == 3
    assert (
        missing.output
        == "workflow-archiver: error: spec file not found: nope.yaml; check the path\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.war"]  # no temp file left


def test_reading_a_war_checks_members_and_manifest(tmp_path: Path) -> None:
    manifest = {"createdOn": "01/01/2024 00:00:00", "archiverVersion": "0.2.15",
                "workflow": {"workflowName": "w", "specFile": "s.yaml", "handler": "h.py"}}  # fmt: skip
    escaping = tmp_path / "escaping.war"
    with zipfile.ZipFile(escaping, "w") as zf:
        zf.writestr("WAR-INF/MANIFEST.json", json.dumps(manifest))
        zf.writestr("s.yaml", "")
        zf.writestr("h.py", "")
        zf.writestr("../evil.py", "")
    with pytest.raises(UnsafeArchive, match="escapes the target folder"):
        open_workflow_archive(escaping)
    lacking = tmp_path / "lacking.war"
    with zipfile.ZipFile(lacking, "w") as zf:
        zf.writestr("WAR-INF/MANIFEST.json", json.dumps(manifest))
        zf.writestr("s.yaml", "")
    with pytest.raises(
        InvalidManifest, match=re.escape("workflow.handler names 'h.py', which is not in")
    ):
        open_workflow_archive(lacking)
    nested = tmp_path / "nested.war"
    manifest["workflow"]["specFile"] = "../s.yaml"  # type: ignore[index]
    with zipfile.ZipFile(nested, "w") as zf:
        zf.writestr("WAR-INF/MANIFEST.json", json.dumps(manifest))
    with pytest.raises(InvalidManifest, match="must name a file at the archive's top"):
        open_workflow_archive(nested)
