"""Find archives (model store or allowed paths) and unpack them into a cache keyed by sha256.

An archive is unpacked once: the cache entry ``<run_dir>/unpacked/<sha256>`` is created by a
rename, so a restart or a second registration of the same bytes reuses it at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import archiver
from archiver import ArchiverError, Manifest, open_archive
from archiver.model_config import load_model_config
from server.download import url_allowed
from server.errors import ArchiveNotAllowed, BadRequest, DigestMismatch, InvalidModel, ModelNotFound
from server.rundir import write_json_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnpackedModel:
    url: str
    model_dir: Path
    manifest: Manifest
    model_config: dict[str, Any]
    sha256: str | None = None  # of the archive file (None for a folder)
    signature: Any = None  # what the unpack's ``verify`` returned (server/signatures.py)


def resolve_url(
    url: str,
    store: Path | None,
    allowed: tuple[str, ...],
    trusted: bool,
    allowed_urls: tuple[str, ...] = (),
) -> Path:
    """The local archive a registration ``url`` names: a name in the model store, an absolute
    path, or a ``file://`` URL. Unless ``trusted`` (the operator's own ``--models`` flag), the
    path as named must lie in the model store or an ``allowed_paths`` entry (or, for a
    ``file://`` URL, match ``allowed_urls``) and hold no ``..``; symlinks inside are followed,
    as TorchServe does (Kubernetes volumes and shared stores are made of them). http(s) URLs are
    server/download.py's."""
    scheme, sep, _ = url.partition("://")
    named = url
    if sep:
        if scheme.lower() != "file":
            raise BadRequest(
                f"url {url!r}: the scheme '{scheme}' is not supported (http, https, file, or a"
                " name in the model store)"
            )
        try:
            parts = urlsplit(url)
        except ValueError as exc:
            raise BadRequest(f"url {url!r} is not a valid URL: {exc}") from None
        if parts.netloc not in ("", "localhost"):
            raise BadRequest(f"url {url!r}: a file URL must name a local path (file:///...)")
        named = unquote(parts.path)
    if "\x00" in named:  # no file system can name it; os calls would raise ValueError
        raise BadRequest(f"url {url!r}: a path cannot hold a NUL character")
    path = Path(named).expanduser()
    if not trusted and ".." in path.parts:
        raise ArchiveNotAllowed(f"url {url!r}: '..' is not allowed")
    if not path.is_absolute():
        if store is None:
            if not trusted:
                raise ModelNotFound(f"url {url!r}: no model_store is configured")
            path = path.resolve()
        else:
            path = store / path
    allowed_url = bool(sep) and url_allowed(url, allowed_urls)
    if not trusted and not allowed_url and not _inside(path, store, allowed):
        raise ArchiveNotAllowed(f"url {url!r} is outside the model store and allowed_paths")
    path = path.resolve()
    try:
        found = path.exists()
    except OSError as exc:  # a name too long for the file system, ...: nothing by that name
        raise ModelNotFound(f"archive not found: {url} ({exc.strerror})") from None
    if not found:
        raise ModelNotFound(f"archive not found: {url}")
    return path


def _inside(path: Path, store: Path | None, allowed: tuple[str, ...]) -> bool:
    """Whether ``path`` (absolute, no ``..``) lies under the store or an allowed path, either as
    named (so that a symlink in the store may point anywhere) or once every link is resolved."""
    roots = [store] if store else []
    roots += [Path(p).expanduser().absolute() for p in allowed]
    named = Path(os.path.normpath(path))
    real = path.resolve()
    return any(named.is_relative_to(root) or real.is_relative_to(root.resolve()) for root in roots)


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB pieces (archives can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# Beside each unpacked archive ``<sha256>``: the digest of the manifest schema its manifest
# was checked against, written once the archive was opened, checked and unpacked.
CHECKED_SUFFIX = ".checked"


def _digest(path: Path, url: str, sha256: str | None, pin: str | None) -> str:
    digest = sha256 or file_sha256(path)
    if pin is not None and digest != pin:
        raise DigestMismatch(
            f"archive {url}: its sha256 is {digest}, the sha256 parameter asks for {pin}"
        )
    return digest


def _unpacked_before(model_dir: Path, marker: Path) -> Manifest | None:
    """The manifest of an archive this cache unpacked before, read from the unpacked folder
    without checking it against the schema again (what the server's start does for its
    startup models: the check imports jsonschema, ~60 ms, for an answer known already). The
    archive's bytes are the same (the folder is named for their sha256), so is the manifest,
    and so is the check's outcome while the schema is the same. None when the cache cannot
    say so: then the archive is opened and checked as the first time."""
    try:
        if json.loads(marker.read_text()).get("schema") != archiver.schema_digest():
            return None
        raw = (model_dir / archiver.MANIFEST_PATH).read_bytes()
        return archiver.parse(raw, str(model_dir / archiver.MANIFEST_PATH), schema_checked=True)
    except (OSError, ArchiverError, KeyError, TypeError, ValueError, AttributeError):
        return None


def unpack(
    path: Path,
    url: str,
    cache: Path,
    sha256: str | None = None,
    pin: str | None = None,
    verify: Callable[[archiver.Archive], Any] | None = None,
) -> UnpackedModel:
    """Open, check and unpack ``path`` (blocking: call it in a thread). ``sha256``: the file's
    digest when already known (a download hashed it on the way in); ``pin``: the digest the
    registration's ``sha256`` parameter asks for; ``verify``: called on the opened archive
    before anything is unpacked (its signature: server/signatures.py), even when the cache
    holds it (the trust may have changed), and may refuse it by raising."""
    signature = None
    if path.is_file():  # an archive this cache unpacked before: its checks are done
        digest = _digest(path, url, sha256, pin)
        model_dir = cache / digest
        manifest = _unpacked_before(model_dir, cache / f"{digest}{CHECKED_SUFFIX}")
        if manifest is not None and verify is None:
            return _unpacked(url, model_dir, manifest, digest)
    else:
        digest = None
    try:
        with open_archive(path) as archive:
            manifest = archive.manifest
            if verify is not None:
                signature = verify(archive)
            if archive.format == "folder":
                if pin is not None:
                    raise BadRequest(
                        f"url {url!r} is an archive folder: the sha256 parameter applies to"
                        " archive files (.mar, .tar.gz)"
                    )
                model_dir = path
            else:
                digest = digest or _digest(path, url, sha256, pin)
                model_dir = cache / digest
                if not model_dir.exists():
                    log.info("unpacking %s into %s", path, model_dir)
                    try:
                        archive.extract(model_dir)
                    except (ArchiverError, OSError):
                        # extract renames a finished folder into place, so a folder there
                        # now is a concurrent registration's of the same bytes, complete:
                        # use it (never remove it: that registration is using it)
                        if not model_dir.is_dir():
                            raise
                marker = cache / f"{digest}{CHECKED_SUFFIX}"
                try:
                    write_json_atomic(marker, {"schema": archiver.schema_digest()})
                except OSError as exc:  # the next start checks again: slower, still right
                    log.warning("could not write %s: %s", marker, exc)
    except ArchiverError as exc:
        raise InvalidModel(f"cannot load archive {url}: {exc}") from exc
    return _unpacked(url, model_dir, manifest, digest, signature)


def _unpacked(
    url: str, model_dir: Path, manifest: Manifest, digest: str | None, signature: Any = None
) -> UnpackedModel:
    """With the model config the archive carries, checked (that is the model's own file)."""
    config: dict[str, Any] = {}
    try:
        if manifest.model.config_file:
            config = load_model_config(model_dir / manifest.model.config_file)
    except ArchiverError as exc:
        raise InvalidModel(f"cannot load archive {url}: {exc}") from exc
    return UnpackedModel(
        url=url, model_dir=model_dir, manifest=manifest, model_config=config, sha256=digest,
        signature=signature,
    )  # fmt: skip


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
