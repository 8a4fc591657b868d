"""Find archives (model store or allowed paths) and unpack them into a cache keyed by sha256.

An archive is unpacked once: the cache entry ``<run_dir>/unpacked/<sha256>`` is created by a
rename, so a restart or a second registration of the same bytes reuses it at once.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import archiver
from archiver import ArchiverError, Manifest, open_archive
from archiver.model_config import load_model_config
from server.errors import ArchiveNotAllowed, InvalidModel, ModelNotFound

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnpackedModel:
    url: str
    model_dir: Path
    manifest: Manifest
    model_config: dict[str, Any]


def resolve_url(url: str, store: Path | None, allowed: tuple[str, ...], trusted: bool) -> Path:
    """The archive a registration ``url`` names. Relative names live in the model store;
    absolute paths must sit under the store or an ``allowed_paths`` entry unless ``trusted``
    (the operator's own ``--models`` flag)."""
    if "://" in url:
        raise ArchiveNotAllowed(f"url {url!r}: only local archives are supported")
    path = Path(url).expanduser()
    if not path.is_absolute():
        if ".." in path.parts:
            raise ArchiveNotAllowed(f"url {url!r}: '..' is not allowed")
        if store is None:
            if not trusted:
                raise ModelNotFound(f"url {url!r}: no model_store is configured")
            path = path.resolve()
        else:
            path = store / path
    path = path.resolve()
    if not trusted:
        roots = [store.resolve()] if store else []
        roots += [Path(p).expanduser().resolve() for p in allowed]
        if not any(path.is_relative_to(root) for root in roots):
            raise ArchiveNotAllowed(f"url {url!r} is outside the model store and allowed_paths")
    if not path.exists():
        raise ModelNotFound(f"archive not found: {url}")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def unpack(path: Path, url: str, cache: Path) -> UnpackedModel:
    """Open, check and unpack ``path`` (blocking: call it in a thread)."""
    try:
        with open_archive(path) as archive:
            manifest = archive.manifest
            if archive.format == "folder":
                model_dir = path
            else:
                model_dir = cache / _sha256(path)
                if not model_dir.exists():
                    log.info("unpacking %s into %s", path, model_dir)
                    try:
                        archive.extract(model_dir)
                    except FileExistsError:
                        pass  # a concurrent registration of the same bytes won
                    except ArchiverError:
                        shutil.rmtree(model_dir, ignore_errors=True)
                        raise
        config: dict[str, Any] = {}
        if manifest.model.config_file:
            config = load_model_config(model_dir / manifest.model.config_file)
    except ArchiverError as exc:
        raise InvalidModel(f"cannot load archive {url}: {exc}") from exc
    return UnpackedModel(url=url, model_dir=model_dir, manifest=manifest, model_config=config)


def store_archives(store: Path) -> list[Path]:
    """Every archive in the store, for ``--models all``."""
    found = []
    for entry in sorted(store.iterdir()):
        if entry.name.startswith("."):
            continue
        if (
            entry.suffix == ".mar"
            or entry.name.endswith(".tar.gz")
            or (entry.is_dir() and (entry / archiver.MANIFEST_PATH).is_file())
        ):
            found.append(entry)
    return found
