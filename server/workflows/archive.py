"""Find a ``.war`` (the workflow store, an allowed path, or a URL within ``allowed_urls``), open
it through archiver's checks and unpack it into ``<run_dir>/workflows/<sha256>/``.

The unpacked folder also serves the workflow's functions: each runs as a model whose handler is
``<handler file>:<function>`` in that folder (TorchServe runs them so), for which the folder gets
a model manifest of its own (``MAR-INF/MANIFEST.json``) beside the workflow's.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import archiver
from archiver import ArchiverError
from archiver.workflow import WorkflowManifest, open_workflow_archive
from server.rundir import write_json_atomic
from server.store import file_sha256
from server.workflows.errors import InvalidWorkflow

log = logging.getLogger(__name__)

# the spec and the handler are read into memory: a few MB is far more than either needs
MAX_SPEC_BYTES = 1 << 20
MAX_HANDLER_BYTES = 4 << 20


@dataclass(frozen=True)
class UnpackedWorkflow:
    url: str
    folder: Path  # the unpacked archive: the functions' model folder too
    manifest: WorkflowManifest
    spec_text: str
    handler_source: str
    sha256: str


def _read(folder: Path, name: str, limit: int, what: str, url: str) -> str:
    path = folder / name
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise InvalidWorkflow(
            f"workflow archive {url}: cannot read its {what} {name}: {exc}"
        ) from exc
    if len(raw) > limit:
        raise InvalidWorkflow(f"workflow archive {url}: its {what} {name} is over {limit} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidWorkflow(f"workflow archive {url}: its {what} {name} is not UTF-8") from None


def unpack_workflow(
    path: Path, url: str, cache: Path, sha256: str | None = None
) -> UnpackedWorkflow:
    """Open, check and unpack the ``.war`` at ``path`` (blocking: call it in a thread)."""
    if not path.is_file():
        raise InvalidWorkflow(f"workflow archive {url} is not a file (a .war)")
    digest = sha256 or file_sha256(path)
    folder = cache / digest
    try:
        with open_workflow_archive(path) as war:
            manifest = war.manifest
            if not folder.is_dir():
                log.info("unpacking workflow archive %s into %s", url, folder)
                cache.mkdir(parents=True, exist_ok=True)
                try:
                    war.extract(folder)
                except (ArchiverError, OSError):
                    if not folder.is_dir():  # else a concurrent registration's, complete
                        raise
    except ArchiverError as exc:
        raise InvalidWorkflow(f"cannot load workflow archive {url}: {exc}") from exc
    except OSError as exc:
        raise InvalidWorkflow(f"cannot unpack workflow archive {url}: {exc}") from exc
    spec_text = _read(folder, manifest.spec_file, MAX_SPEC_BYTES, "spec file", url)
    handler_source = _read(folder, manifest.handler, MAX_HANDLER_BYTES, "handler", url)
    return UnpackedWorkflow(url, folder, manifest, spec_text, handler_source, digest)


def functions_manifest(unpacked: UnpackedWorkflow) -> None:
    """Give the unpacked folder the model manifest its functions are registered with (each
    registration names its own model and ``<handler>:<function>``)."""
    target = unpacked.folder / archiver.MANIFEST_PATH
    manifest = {
        "createdOn": unpacked.manifest.created_on or "01/01/1970 00:00:00",
        "runtime": "python",
        "model": {
            "modelName": "workflow-functions",
            "handler": unpacked.manifest.handler,
            "modelVersion": "1.0",
        },
        "archiverVersion": f"mserve-{archiver.__version__}",
    }
    if target.is_file():
        try:
            if json.loads(target.read_text()) == manifest:
                return
        except (OSError, ValueError):
            pass
    target.parent.mkdir(exist_ok=True)
    write_json_atomic(target, manifest)
