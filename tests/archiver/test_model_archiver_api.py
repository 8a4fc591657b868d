"""TorchServe's ``model_archiver`` Python API (compat/torchserve/model_archiver), as installed by
``pip install ./compat/torchserve`` (scripts/test.sh) and imported as TorchServe's tests and
users' build scripts import it: the archive it writes is the one our command writes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from archiver import open_archive
from tests.conftest import ArchiverRunner, CompatTool

ARGS = [
    "--model-name", "m", "-v", "2.5",
    "--serialized-file", "weights.pt", "--model-file", "model.py",
    "--handler", "handler.py", "--extra-files", "labels.json,src",
    "-r", "requirements.txt", "-c", "config.yaml",
]  # fmt: skip
TARGETS = {"default": "m.mar", "zip-store": "m.mar", "tgz": "m.tar.gz", "no-archive": "m"}


def _config(export_path: Path, /, **changes: Any) -> Any:
    from model_archiver import ModelArchiverConfig

    fields: dict[str, Any] = {
        "model_name": "m",
        "version": "2.5",
        "serialized_file": "weights.pt",
        "model_file": "model.py",
        "handler": "handler.py",
        "extra_files": "labels.json,src",
        "requirements_file": "requirements.txt",
        "config_file": "config.yaml",
        "export_path": str(export_path),
        "runtime": "python",
        "force": False,
        "archive_format": "default",
    }
    return ModelArchiverConfig(**{**fields, **changes})


def _same_archive(ours: Path, cli: Path) -> None:
    """Same manifest (all but the clock, digests included) and the same members."""
    with open_archive(ours) as a, open_archive(cli) as b:
        made = json.loads(a.read_bytes("MAR-INF/MANIFEST.json"))
        expected = json.loads(b.read_bytes("MAR-INF/MANIFEST.json"))
        assert made.pop("createdOn") and expected.pop("createdOn")
        assert made == expected
        assert list(made["model"]) == list(expected["model"])
        assert sorted(m.name for m in a.members) == sorted(m.name for m in b.members)
        assert a.verify().ok


def test_installed_from_the_compat_wheel() -> None:
    """Imported from site-packages (the wheel), with TorchServe's names and version."""
    import model_archiver
    from model_archiver import ModelArchiver, ModelArchiverConfig  # noqa: F401
    from model_archiver.manifest_components.manifest import RuntimeType
    from model_archiver.model_archiver_config import ModelArchiverConfig as Config
    from model_archiver.model_archiver_error import ModelArchiverError  # noqa: F401
    from model_archiver.model_packaging import generate_model_archive  # noqa: F401

    assert "site-packages" in Path(model_archiver.__file__).parts
    assert model_archiver.__version__ == "0.12.0"
    assert Config is ModelArchiverConfig
    assert [r.value for r in RuntimeType] == ["python", "python3", "LSP"]


@pytest.mark.parametrize("fmt", ["default", "tgz", "no-archive"])
def test_generate_model_archive_matches_the_command(
    archiver: ArchiverRunner, model_inputs: Path, fmt: str
) -> None:
    from model_archiver.model_packaging import generate_model_archive

    (model_inputs / "api").mkdir()
    (model_inputs / "cli").mkdir()
    result = archiver(*ARGS, "--archive-format", fmt, "--export-path", "cli")
    assert result.exit_code == 0, result.output
    out = generate_model_archive(_config(model_inputs / "api", archive_format=fmt))
    assert out == model_inputs / "api" / TARGETS[fmt]
    _same_archive(out, model_inputs / "cli" / TARGETS[fmt])


def test_model_archiver_class_and_from_args(archiver: ArchiverRunner, model_inputs: Path) -> None:
    from model_archiver import ModelArchiver, ModelArchiverConfig
    from model_archiver.arg_parser import ArgParser

    (model_inputs / "api").mkdir()
    (model_inputs / "cli").mkdir()
    assert archiver(*ARGS, "--export-path", "cli").exit_code == 0
    config = ArgParser.export_model_args_parser([*ARGS, "--export-path", "api"])
    assert config == ModelArchiverConfig.from_args(
        ArgParser.parser().parse_args(config_argv := [*ARGS, "--export-path", "api"])
    )
    assert config_argv  # the same argv, parsed twice
    ModelArchiver.generate_model_archive(config)
    _same_archive(model_inputs / "api" / "m.mar", model_inputs / "cli" / "m.mar")


@pytest.mark.parametrize(
    ("changes", "code", "message"),
    [
        (
            {"serialized_file": "missing.pt"},
            "input_not_found",
            "serialized file not found: missing.pt; check the path",
        ),
        (
            {"export_path": "nowhere"},
            "export_path_missing",
            "export path does not exist or is not a folder: nowhere",
        ),
        ({"model_name": "bad name"}, "usage_error", "invalid --model-name 'bad name'"),
        (
            {"archive_format": "rar"},
            "usage_error",
            "ModelArchiverConfig.archive_format must be one of default, tgz, no-archive, zip-store, got 'rar'",
        ),
        (
            {"version": None},
            "usage_error",
            "ModelArchiverConfig.version must be a non-empty string, got None",
        ),
    ],
)
def test_errors_are_model_archiver_errors(
    model_inputs: Path,
    monkeypatch: pytest.MonkeyPatch,
    changes: dict[str, Any],
    code: str,
    message: str,
) -> None:
    from model_archiver.model_archiver_error import ModelArchiverError
    from model_archiver.model_packaging import generate_model_archive

    monkeypatch.chdir(model_inputs)
    with pytest.raises(ModelArchiverError) as caught:
        generate_model_archive(_config(model_inputs, **changes))
    assert str(caught.value).startswith(message)
    assert caught.value.code == code
    assert not (model_inputs / "m.mar").exists()


def test_existing_archive_needs_force(model_inputs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from model_archiver import ModelArchiverError
    from model_archiver.model_packaging import generate_model_archive

    monkeypatch.chdir(model_inputs)
    generate_model_archive(_config(model_inputs))
    with pytest.raises(
        ModelArchiverError, match=r"^output already exists: .*m\.mar; use -f/--force"
    ):
        generate_model_archive(_config(model_inputs))
    generate_model_archive(_config(model_inputs, force=True))


# TorchServe's test/pytest/conftest.py ``model_archiver`` fixture, as it runs: their own
# model_packaging.py loaded as the module ``archiver`` (shadowing ours in sys.modules), its
# ArgParser and zipfile patched, then generate_model_archive(). Run in a child process: the
# fixture replaces ``sys.modules["archiver"]``.
THEIR_FIXTURE = """
import importlib.machinery, importlib.util, sys
from unittest.mock import patch
from zipfile import ZIP_STORED, ZipFile
from model_archiver import ModelArchiverConfig

loader = importlib.machinery.SourceFileLoader("archiver", sys.argv[1])
module = importlib.util.module_from_spec(importlib.util.spec_from_loader("archiver", loader))
sys.modules["archiver"] = module
loader.exec_module(module)
config = ModelArchiverConfig(**{CONFIG})
with patch("archiver.ArgParser.export_model_args_parser", return_value=config):
    with patch(
        "model_archiver.model_packaging_utils.zipfile.ZipFile",
        lambda x, y, _: ZipFile(x, y, ZIP_STORED),
    ):
        module.generate_model_archive()
assert sys.modules["archiver"] is module
del sys.modules["archiver"]
"""


@pytest.mark.slow
def test_torchserve_test_fixture_runs_their_model_packaging(
    tma: CompatTool, archiver: ArchiverRunner, model_inputs: Path
) -> None:
    """Their model_packaging.py (from the real torch-model-archiver 0.12.0) over our package."""
    theirs = next(
        tma.python.parent.parent.glob("lib/python*/site-packages/model_archiver/model_packaging.py")
    )
    (model_inputs / "api").mkdir()
    (model_inputs / "cli").mkdir()
    assert archiver(*ARGS, "--export-path", "cli").exit_code == 0
    config = {k: v for k, v in vars(_config(model_inputs / "api")).items()}
    code = textwrap.dedent(THEIR_FIXTURE).replace("{CONFIG}", repr(config))
    done = subprocess.run(
        [sys.executable, "-c", code, str(theirs)],
        cwd=model_inputs,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    _same_archive(model_inputs / "api" / "m.mar", model_inputs / "cli" / "m.mar")
    assert not list(Path(__import__("tempfile").gettempdir()).glob("mserve-model-archiver-m-*"))
