"""``ModelExportUtils``: the steps TorchServe's own ``model_packaging.py`` calls, over our archiver.

TorchServe's test suite does not call our ``generate_model_archive``: its ``model_archiver``
fixture (test/pytest/conftest.py) loads ``model_packaging.py`` from the TorchServe checkout and
runs it, and that file imports this module and calls, in order, ``generate_manifest_json``,
``validate_inputs``, ``check_mar_already_exists``, ``copy_artifacts``, ``archive`` and then
removes the folder ``copy_artifacts`` returned. Those steps are kept so that their file runs,
but nothing is staged: ``copy_artifacts`` writes only the plan (the input paths) into a fresh
folder and ``archive`` hands the plan and the manifest's fields to ``build_archive``, the same
call ``generate_model_archive`` makes, so the archive is the one our command writes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import types
import zipfile as _zipfile
from pathlib import Path
from typing import Any

from archiver.cli import ARCHIVER_VERSION
from archiver.errors import ExportPathMissing, OutputExists
from archiver.manifest import created_on, is_valid_model_name, model_name_pattern
from archiver.writer import ArchiveFormat, target_path
from model_archiver.model_archiver_config import ModelArchiverConfig
from model_archiver.model_archiver_error import ModelArchiverError
from model_archiver.model_packaging import build_archive, our_archiver

# TorchServe's tests patch ``model_archiver.model_packaging_utils.zipfile.ZipFile`` (to store
# instead of deflate, for speed). Patching the real ``zipfile`` module would replace ZipFile for
# the whole process, our writer and reader included, with a lambda of another signature; this
# namespace takes the patch instead, and our writer, already fast at deflating, is left alone.
zipfile = types.SimpleNamespace(
    ZipFile=_zipfile.ZipFile, ZIP_STORED=_zipfile.ZIP_STORED, ZIP_DEFLATED=_zipfile.ZIP_DEFLATED
)

PLAN_FILE = "mserve-archive-plan.json"
# copy_artifacts' keyword names, as TorchServe's model_packaging.py passes them -> config field
_ARTIFACTS = {
    "model_file": "model_file",
    "serialized_file": "serialized_file",
    "handler": "handler",
    "extra_files": "extra_files",
    "requirements-file": "requirements_file",
    "config_file": "config_file",
}


def _format(archive_format: str) -> ArchiveFormat:
    try:
        return ArchiveFormat(archive_format)
    except ValueError:
        formats = ", ".join(f.value for f in ArchiveFormat)
        raise ModelArchiverError(
            f"archive format must be one of {formats}, got {archive_format!r}"
        ) from None


class ModelExportUtils:
    @staticmethod
    def get_archive_export_path(export_file_path: str, model_name: str, archive_format: str) -> str:
        """Where the archive goes: ``<export path>/<model name>.mar`` (``.tar.gz``, folder)."""
        return str(target_path(Path(export_file_path), model_name, _format(archive_format)))

    @staticmethod
    def validate_inputs(model_name: str, export_path: str | None) -> None:
        with our_archiver():  # the name's pattern is read from our packaged schema
            valid = is_valid_model_name(model_name)
        if not valid:
            raise ModelArchiverError(
                f"invalid --model-name {model_name!r}; use letters, digits, '_', '-' and '.',"
                f" starting with a letter or digit (the pattern {model_name_pattern()} that"
                " TorchServe applies)"
            )
        if export_path is not None and not Path(export_path).is_dir():
            error = ExportPathMissing(os.fspath(export_path))
            raise ModelArchiverError(str(error), error.code)

    @staticmethod
    def check_mar_already_exists(
        model_name: str,
        export_file_path: str | None,
        overwrite: bool,
        archive_format: str = "default",
    ) -> str:
        """The export folder (the working folder when None); raises if the archive exists and
        ``overwrite`` is false."""
        export_dir = os.fspath(export_file_path) if export_file_path is not None else os.getcwd()
        target = Path(
            ModelExportUtils.get_archive_export_path(export_dir, model_name, archive_format)
        )
        if not overwrite and (target.exists() or target.is_symlink()):
            error = OutputExists(str(target))
            raise ModelArchiverError(str(error), error.code)
        return export_dir

    @staticmethod
    def generate_manifest_json(config: ModelArchiverConfig) -> str:
        """The manifest's fields for ``config`` (the archive's own manifest, digests included,
        is written by ``archive``)."""
        model: dict[str, Any] = {"modelName": config.model_name, "handler": config.handler}
        for key, value in (
            ("serializedFile", config.serialized_file),
            ("modelFile", config.model_file),
            ("requirementsFile", config.requirements_file),
            ("configFile", config.config_file),
        ):
            if value:
                model[key] = Path(value).name
        model["modelVersion"] = config.version
        return json.dumps(
            {
                "createdOn": created_on(),
                "runtime": config.runtime,
                "model": model,
                "archiverVersion": ARCHIVER_VERSION,
            },
            indent=2,
        )

    @staticmethod
    def copy_artifacts(model_name: str, runtime: str, **artifacts: str | None) -> str:
        """A fresh folder holding the plan: which file each flag names (nothing is copied; the
        writer reads the inputs once, where they are). The caller removes the folder."""
        unknown = sorted(set(artifacts) - set(_ARTIFACTS))
        if unknown:
            raise ModelArchiverError(f"copy_artifacts: unknown artifact {', '.join(unknown)}")
        plan = {
            field: os.fspath(artifacts[key]) if artifacts.get(key) else None
            for key, field in _ARTIFACTS.items()
        }
        plan["runtime"] = runtime
        folder = tempfile.mkdtemp(prefix=f"mserve-model-archiver-{model_name}-")
        Path(folder, PLAN_FILE).write_text(json.dumps(plan), encoding="utf-8")
        return folder

    @staticmethod
    def archive(
        export_file: str,
        model_name: str,
        model_path: str,
        manifest: str,
        archive_format: str = "default",
    ) -> None:
        """Write the archive planned in ``model_path`` (by ``copy_artifacts``) into the folder
        ``export_file``, with the model version and runtime of ``manifest``."""
        plan_path = Path(model_path, PLAN_FILE)
        if not plan_path.is_file():
            raise ModelArchiverError(
                f"{model_path} was not made by ModelExportUtils.copy_artifacts (no {PLAN_FILE});"
                " build archives with generate_model_archive(ModelArchiverConfig(...))"
            )
        plan = json.loads(plan_path.read_text(encoding="utf-8"))
        fields = json.loads(manifest)
        runtime = fields.get("runtime") or plan.pop("runtime")
        plan.pop("runtime", None)
        config = ModelArchiverConfig(
            model_name=model_name,
            version=fields["model"]["modelVersion"],
            export_path=export_file,
            archive_format=archive_format,  # type: ignore[arg-type]  (checked by build_archive)
            runtime=runtime,
            force=True,  # check_mar_already_exists has decided
            **plan,
        )
        try:
            build_archive(config)
        except BaseException:
            shutil.rmtree(model_path, ignore_errors=True)  # the caller removes it on success only
            raise
