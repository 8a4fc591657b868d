"""Workflow archives (``.war``): TorchServe's ``torch-workflow-archiver`` layout, written and read.

A workflow archive is a zip whose top level holds the workflow's spec (YAML: the models and the
DAG), its handler file (the Python functions the DAG names) and any extra files, flat, beside
``WAR-INF/MANIFEST.json``::

    {"createdOn": "...", "workflow": {"workflowName", "specFile", "handler"},
     "archiverVersion": "..."}

The models themselves are not inside: the spec names their ``.mar`` files by URL (the model
store, or a URL), as TorchServe's does. Reading one goes through the same checks as a model
archive (:class:`archiver.reader.Archive`: safe member names, bounded sizes, extraction into a
temp folder renamed into place). What the spec means is the server's business
(server/workflows/spec.py).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from archiver import __version__
from archiver.errors import (
    ArchiverError,
    ExportPathMissing,
    InputNotFound,
    InvalidManifest,
    OutputExists,
    UsageError,
)
from archiver.manifest import FileDigest, created_on
from archiver.reader import Archive as _Archive
from archiver.reader import ExtractLimits

WAR_MANIFEST_PATH = "WAR-INF/MANIFEST.json"
# TorchServe's workflow-archiver checks names with this pattern (a full match here)
WORKFLOW_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_\-.]*"
# a spec, a handler and a few extra files: a workflow archive holds no weights, so its bounds
# are far below a model archive's
WORKFLOW_LIMITS = ExtractLimits(
    max_members=1_000, max_member_bytes=64 << 20, max_total_bytes=256 << 20, max_ratio=200.0
)
MAX_WAR_MANIFEST_BYTES = 64 << 10


def is_valid_workflow_name(name: str) -> bool:
    return re.fullmatch(WORKFLOW_NAME_PATTERN, name) is not None


@dataclass(frozen=True)
class WorkflowManifest:
    """``WAR-INF/MANIFEST.json``, with TorchServe's field names on the wire."""

    workflow_name: str
    spec_file: str
    handler: str
    created_on: str = ""
    archiver_version: str = ""
    description: str = ""
    # what the reader's member checks expect of a manifest: a workflow archive records no
    # digests and names no files the reader must find
    files: dict[str, FileDigest] = field(default_factory=dict)

    def referenced_files(self) -> dict[str, str]:
        return {"specFile": self.spec_file, "handler": self.handler}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "createdOn": self.created_on,
            "workflow": {
                "workflowName": self.workflow_name,
                "specFile": self.spec_file,
                "handler": self.handler,
            },
            "archiverVersion": self.archiver_version,
        }
        if self.description:
            out["description"] = self.description
        return out


def parse_workflow_manifest(raw: bytes, where: str) -> WorkflowManifest:
    """Read ``WAR-INF/MANIFEST.json``; what TorchServe's server requires of it is required here
    (a ``workflow`` with its ``workflowName``, ``archiverVersion``, ``createdOn``), and the two
    files it names must be plain names at the archive's top (the archiver writes them so)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidManifest(where, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidManifest(where, f"expected a JSON object, found {type(data).__name__}")
    workflow = data.get("workflow")
    if not isinstance(workflow, dict):
        raise InvalidManifest(where, "no 'workflow' object (the workflow's name, spec and handler)")
    values: dict[str, str] = {}
    for key in ("workflowName", "specFile", "handler"):
        value = workflow.get(key)
        if not isinstance(value, str) or not value:
            raise InvalidManifest(where, f"workflow.{key} is missing or not a string")
        values[key] = value
    for key in ("archiverVersion", "createdOn"):
        if not isinstance(data.get(key), str):
            raise InvalidManifest(where, f"{key} is missing or not a string")
    for key in ("specFile", "handler"):
        name = values[key]
        if "/" in name or "\\" in name or name in (".", "..") or "\x00" in name:
            raise InvalidManifest(
                where, f"workflow.{key} {name!r} must name a file at the archive's top"
            )
    description = data.get("description")
    return WorkflowManifest(
        workflow_name=values["workflowName"],
        spec_file=values["specFile"],
        handler=values["handler"],
        created_on=data["createdOn"],
        archiver_version=data["archiverVersion"],
        description=description if isinstance(description, str) else "",
    )


class WorkflowArchive(_Archive):
    """An opened, checked ``.war``: the model archive reader's member checks and safe
    extraction, with the workflow's manifest."""

    manifest_path = WAR_MANIFEST_PATH
    kind = "a workflow archive"
    manifest: WorkflowManifest  # type: ignore[assignment]

    def _parse_manifest(self, raw: bytes, where: str) -> WorkflowManifest:  # type: ignore[override]
        if len(raw) > MAX_WAR_MANIFEST_BYTES:
            raise InvalidManifest(where, f"larger than {MAX_WAR_MANIFEST_BYTES} bytes")
        return parse_workflow_manifest(raw, where)

    def check_files(self) -> None:
        """The spec and handler the manifest names are in the archive."""
        names = {m.name for m in self.members if not m.is_dir}
        for key, name in self.manifest.referenced_files().items():
            if name not in names:
                raise InvalidManifest(
                    f"{self.path}:{WAR_MANIFEST_PATH}",
                    f"workflow.{key} names {name!r}, which is not in the archive",
                )


def open_workflow_archive(path: Path | str, limits: ExtractLimits | None = None) -> WorkflowArchive:
    """Open ``path`` (a ``.war`` zip, or an unpacked folder), check its members and manifest."""
    archive = WorkflowArchive(Path(path), limits or WORKFLOW_LIMITS)
    try:
        archive.check_files()
    except BaseException:
        archive.close()
        raise
    return archive


def write_workflow_archive(
    workflow_name: str,
    spec_file: Path,
    handler: Path,
    export_path: Path,
    extra_files: tuple[Path, ...] = (),
    force: bool = False,
) -> Path:
    """Write ``<export_path>/<workflow_name>.war`` as TorchServe's workflow-archiver lays it
    out: every input at the top of the zip under its own file name, then the manifest. The zip
    is written beside the target and renamed into place; an existing target is kept unless
    ``force``."""
    if not is_valid_workflow_name(workflow_name):
        raise UsageError(
            f"workflow name {workflow_name!r} has characters that are not allowed",
            hint=f"it must match {WORKFLOW_NAME_PATTERN} (letters, digits, '_', '-', '.')",
        )
    if not export_path.is_dir():
        raise ExportPathMissing(str(export_path))
    members: dict[str, Path] = {}
    inputs = [("spec file", spec_file), ("handler", handler)]
    inputs += [("extra file", p) for p in extra_files]
    for what, path in inputs:
        if not path.is_file():
            raise InputNotFound(what, str(path))
        name = path.name
        if name in members and members[name].resolve() != path.resolve():
            raise UsageError(
                f"two inputs are named {name!r} ({members[name]} and {path})",
                hint="a workflow archive is flat: every file lies at its top under its own name",
            )
        members[name] = path
    target = export_path / f"{workflow_name}.war"
    if target.exists() and not force:
        raise OutputExists(str(target))
    manifest = WorkflowManifest(
        workflow_name=workflow_name,
        spec_file=spec_file.name,
        handler=handler.name,
        created_on=created_on(),
        archiver_version=__version__,
    )
    tmp = export_path / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, path in members.items():
                zf.write(path, str(PurePosixPath(name)))
            zf.writestr(WAR_MANIFEST_PATH, json.dumps(manifest.to_json(), indent=2))
        if force:
            os.replace(tmp, target)
        else:
            try:
                os.link(tmp, target)  # "create if absent": a concurrent writer makes this fail
            except FileExistsError:
                raise OutputExists(str(target)) from None
    except OSError as exc:
        raise ArchiverError(f"cannot write {target}: {exc.strerror or exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return target
