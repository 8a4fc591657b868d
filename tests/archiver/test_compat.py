"""Compatibility with the real torch-model-archiver 0.12.0 and MMS model-archiver 1.0.3.

Both tools are installed for real (see conftest). We read what they write, and what we write
matches what they write for the same inputs and passes the checks their readers apply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from archiver import open_archive
from tests.conftest import ArchiverRunner, CompatTool

# Fields that legitimately differ between two runs or two tools: the clock, the tool's own
# version, and mserve's namespaced digests (which other readers ignore).
VOLATILE = ("createdOn", "archiverVersion", "mserve")

TMA_FORMATS = {"default": "m.mar", "zip-store": "m.mar", "tgz": "m.tar.gz", "no-archive": "m"}
MMS_FORMATS = {"default": "m.mar", "tgz": "m.tar.gz", "no-archive": "m"}

# Inputs both tools pack identically: files only (TMA flattens folders in --extra-files).
COMMON_ARGS = [
    "--model-name", "m", "-v", "2.5",
    "--serialized-file", "weights.pt", "--model-file", "model.py",
    "--handler", "handler.py", "--extra-files", "labels.json",
    "-r", "requirements.txt", "-c", "config.yaml",
]  # fmt: skip


def _stable(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in manifest.items() if k not in VOLATILE}


def torchserve_frontend_accepts(manifest: dict[str, Any]) -> list[str]:
    """The checks TorchServe's frontend applies when it loads an archive (ModelArchive.validate
    and its Gson Manifest: model, modelName and modelVersion present, runtime a known value)."""
    problems = []
    model = manifest.get("model")
    if not isinstance(model, dict):
        return ["Missing Model entry in manifest file."]
    if model.get("modelName") is None:
        problems.append("Model name is not defined.")
    if model.get("modelVersion") is None:
        problems.append("Model version is not defined.")
    if manifest.get("runtime", "python") not in ("python", "python2", "python3"):
        problems.append("Runtime is not defined or invalid.")
    return problems


@pytest.mark.parametrize("fmt", list(TMA_FORMATS))
def test_reads_torch_model_archiver_output(
    tma: CompatTool, model_inputs: Path, fmt: str, tmp_path: Path
) -> None:
    made = tma.run(*COMMON_ARGS, "--archive-format", fmt, cwd=model_inputs)
    assert made.returncode == 0, made.stderr
    with open_archive(model_inputs / TMA_FORMATS[fmt]) as archive:
        manifest = archive.manifest
        assert manifest.writer == "torch-model-archiver"
        assert manifest.archiver_version == "0.12.0"
        assert manifest.model.model_name == "m"
        assert manifest.model.model_version == "2.5"
        assert manifest.model.handler == "handler.py"
        assert manifest.referenced_files() == {
            "serializedFile": "weights.pt",
            "modelFile": "model.py",
            "requirementsFile": "requirements.txt",
            "configFile": "config.yaml",
        }
        report = archive.verify()
        assert report.ok and not report.recorded
        dest = archive.extract(tmp_path / "unpacked")
    assert (dest / "weights.pt").read_bytes() == (model_inputs / "weights.pt").read_bytes()
    assert (dest / "MAR-INF" / "MANIFEST.json").is_file()


@pytest.mark.parametrize("fmt", list(MMS_FORMATS))
def test_reads_mms_model_archiver_output(mms: CompatTool, tmp_path: Path, fmt: str) -> None:
    model_dir = tmp_path / "model"
    (model_dir / "sub").mkdir(parents=True)
    (model_dir / "h.py").write_text("def handle(data, context):\n    return data\n")
    (model_dir / "sub" / "params.bin").write_bytes(b"\x02" * 1000)
    made = mms.run(
        "--model-name", "m", "--handler", "h:handle", "--model-path", "model",
        "--runtime", "python3", "--archive-format", fmt, cwd=tmp_path,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    with open_archive(tmp_path / MMS_FORMATS[fmt]) as archive:
        manifest = archive.manifest
        assert manifest.writer == "mms"
        assert manifest.runtime == "python3"
        assert manifest.model.handler == "h:handle"
        assert manifest.model.model_version == "1.0"  # MMS writes none: TorchServe's default
        assert manifest.extra["specificationVersion"] == "1.0"
        assert {m.name for m in archive.members if not m.is_dir} == {
            "h.py",
            "sub/params.bin",
            "MAR-INF/MANIFEST.json",
        }
        assert archive.verify().ok
        assert archive.extract(tmp_path / "out").joinpath("sub/params.bin").stat().st_size == 1000


def test_legacy_manifest_without_version_gets_default(tma: CompatTool, model_inputs: Path) -> None:
    """torch-model-archiver writes no modelVersion for ``-v ''``; readers default it to 1.0."""
    made = tma.run("--model-name", "old", "--handler", "handler.py", "-v", "", cwd=model_inputs)
    assert made.returncode == 0, made.stderr
    with open_archive(model_inputs / "old.mar") as archive:
        assert (
            "modelVersion" not in json.loads(archive.read_bytes("MAR-INF/MANIFEST.json"))["model"]
        )
        assert archive.manifest.model.model_version == "1.0"


@pytest.mark.parametrize("fmt", list(TMA_FORMATS))
def test_our_output_matches_torch_model_archiver(
    tma: CompatTool, archiver: ArchiverRunner, model_inputs: Path, fmt: str
) -> None:
    """Same inputs, same manifest (fields, values, key order) and same member list."""
    (model_inputs / "tma").mkdir()
    (model_inputs / "ours").mkdir()
    made = tma.run(*COMMON_ARGS, "--archive-format", fmt, "--export-path", "tma", cwd=model_inputs)
    assert made.returncode == 0, made.stderr
    result = archiver(*COMMON_ARGS, "--archive-format", fmt, "--export-path", "ours")
    assert result.exit_code == 0, result.output
    with (
        open_archive(model_inputs / "tma" / TMA_FORMATS[fmt]) as theirs,
        open_archive(model_inputs / "ours" / TMA_FORMATS[fmt]) as ours,
    ):
        their_json = json.loads(theirs.read_bytes("MAR-INF/MANIFEST.json"))
        our_json = json.loads(ours.read_bytes("MAR-INF/MANIFEST.json"))
        assert list(_stable(our_json).items()) == list(_stable(their_json).items())
        assert list(our_json) == [*their_json, "mserve"]
        assert {m.name for m in ours.members} == {m.name for m in theirs.members}


def test_our_manifest_passes_their_readers(
    tma: CompatTool, mms: CompatTool, archiver: ArchiverRunner, model_inputs: Path
) -> None:
    """Rebuild our manifest with each tool's own Manifest classes (which check the runtime and
    fields) and with TorchServe's frontend checks: all accept it and agree on its content."""
    assert archiver(*COMMON_ARGS).exit_code == 0
    with open_archive(model_inputs / "m.mar") as archive:
        ours = json.loads(archive.read_bytes("MAR-INF/MANIFEST.json"))
    assert torchserve_frontend_accepts(ours) == []
    (model_inputs / "ours.json").write_text(json.dumps(ours))
    rebuilt_by_tma = tma.python_code(
        "import json\n"
        "from model_archiver.manifest_components.manifest import Manifest\n"
        "from model_archiver.manifest_components.model import Model\n"
        "d = json.load(open('ours.json')); m = d['model']\n"
        "model = Model(m['modelName'], m.get('serializedFile'), m['handler'],"
        " model_file=m.get('modelFile'), model_version=m.get('modelVersion'),"
        " requirements_file=m.get('requirementsFile'), config_file=m.get('configFile'))\n"
        "print(json.dumps(Manifest(runtime=d['runtime'], model=model).manifest_dict))\n",
        cwd=model_inputs,
    )
    assert _stable(json.loads(rebuilt_by_tma)) == _stable(ours)
    rebuilt_by_mms = mms.python_code(
        "import json\n"
        "from model_archiver.manifest_components.manifest import Manifest, RuntimeType\n"
        "from model_archiver.manifest_components.model import Model\n"
        "d = json.load(open('ours.json')); m = d['model']\n"
        "man = Manifest(runtime=RuntimeType(d['runtime']).value,"
        " model=Model(m['modelName'], m['handler'], model_version=m['modelVersion']))\n"
        "print(str(man))\n",
        cwd=model_inputs,
    )
    mms_model = json.loads(rebuilt_by_mms)["model"]
    assert mms_model == {"modelName": "m", "handler": "handler.py", "modelVersion": "2.5"}


def test_their_errors_we_fix(tma: CompatTool, archiver: ArchiverRunner, model_inputs: Path) -> None:
    """torch-model-archiver crashes with a traceback on ``file.py:function``; we accept it."""
    theirs = tma.run(
        "--model-name", "x", "-v", "1", "--handler", "handler.py:handle", cwd=model_inputs
    )
    assert theirs.returncode != 0 and "Traceback" in theirs.stderr
    result = archiver("--model-name", "x", "--handler", "handler.py:handle")
    assert result.exit_code == 0, result.output
