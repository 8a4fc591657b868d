"""Write archives: zip ``.mar`` (deflated or stored), ``.tar.gz`` or a plain folder.

Three promises. Streaming: each input is read once in fixed-size chunks, hashed and written in
the same pass, so a multi-GB weights file never sits in memory. Atomic: everything is built in a
private temp path next to the target and renamed into place; a failure removes the temp path and
leaves nothing behind, and without ``force`` an existing target is never replaced, even by a
concurrent run. Reproducible: with ``SOURCE_DATE_EPOCH`` set, equal inputs give equal bytes.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import secrets
import shutil
import stat
import tarfile
import time
import zipfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import BinaryIO

from archiver.errors import OutputExists
from archiver.manifest import MANIFEST_PATH, SIGNATURE_PATH, FileDigest, Manifest, created_on
from archiver.members import Member

CHUNK_BYTES = 1 << 20
_ZIP_EPOCH_MIN = 315532800  # 1980-01-01, the earliest time a zip entry can carry

Progress = Callable[[int], None]
# Signs the content once its digests are known: (manifest bytes, digests) -> a signature
# bundle, written as SIGNATURE_PATH after the manifest (archiver/signing/ makes one)
Sign = Callable[[bytes, Mapping[str, FileDigest]], bytes]


class ArchiveFormat(str, Enum):
    DEFAULT = "default"
    TGZ = "tgz"
    NO_ARCHIVE = "no-archive"
    ZIP_STORE = "zip-store"

    @property
    def suffix(self) -> str:
        return {"default": ".mar", "zip-store": ".mar", "tgz": ".tar.gz", "no-archive": ""}[
            self.value
        ]


def target_path(export_dir: Path, model_name: str, fmt: ArchiveFormat) -> Path:
    return export_dir / f"{model_name}{fmt.suffix}"


def source_date_epoch() -> int | None:
    """``SOURCE_DATE_EPOCH`` as an int, or None when unset (reproducible-builds.org convention)."""
    raw = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    return int(raw) if raw.isdigit() else None


def _copy_hashing(src: BinaryIO, dst: BinaryIO, progress: Progress | None) -> FileDigest:
    """Copy and sha256 in one pass. The hash of chunk n runs on a helper thread while chunk n is
    written (hashlib and zlib release the GIL), so hashing costs little on top of the write."""
    digest = hashlib.sha256()
    size = 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") as hasher:
        pending: Future[None] | None = None
        while chunk := src.read(CHUNK_BYTES):
            if pending is not None:
                pending.result()
            pending = hasher.submit(digest.update, chunk)
            dst.write(chunk)
            size += len(chunk)
            if progress:
                progress(len(chunk))
        if pending is not None:
            pending.result()
    return FileDigest(sha256=digest.hexdigest(), size_bytes=size)


class _HashingReader(io.RawIOBase):
    """A file reader that hashes what tarfile pulls through it (tarfile reads, we cannot push)."""

    def __init__(self, raw: BinaryIO, progress: Progress | None) -> None:
        self._raw = raw
        self._progress = progress
        self.digest = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = self._raw.readinto(buffer)  # type: ignore[attr-defined]
        if n:
            view = memoryview(buffer)[:n]
            self.digest.update(view)
            self.size += n
            if self._progress:
                self._progress(n)
        return n or 0


_SAMPLE_BYTES = 256 << 10
_SAMPLE_MIN_BYTES = 1 << 20
_STORE_ABOVE_RATIO = 0.9


def _worth_deflating(src: BinaryIO, size: int) -> bool:
    """Deflate only what it shrinks by 10% or more, judged on three samples of the file.

    Float weights barely compress and deflate crawls through them (docs/archiver.md has the
    figures), so ``default`` stores them and stays fast; text, code and sparse data still shrink.
    The choice depends on content alone, so it keeps archives reproducible.
    """
    if size < _SAMPLE_MIN_BYTES:
        return True
    sample = bytearray()
    for offset in (0, size // 2, size - _SAMPLE_BYTES):
        src.seek(offset)
        sample += src.read(_SAMPLE_BYTES)
    src.seek(0)
    return len(zlib.compress(sample, 1)) < _STORE_ABOVE_RATIO * len(sample)


def _zip_info(name: str, date_time: tuple[int, ...], method: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=date_time)
    info.compress_type = method
    info.external_attr = (stat.S_IFREG | 0o644) << 16
    info.create_system = 3  # unix, so the mode bits above are honoured
    return info


def _write_zip(
    tmp: Path,
    members: Sequence[Member],
    manifest: Manifest,
    epoch: int,
    stored: bool,
    progress: Progress | None,
    sign: Sign | None = None,
) -> dict[str, FileDigest]:
    date_time = time.gmtime(max(epoch, _ZIP_EPOCH_MIN))[:6]
    default = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
    digests: dict[str, FileDigest] = {}
    with zipfile.ZipFile(tmp, "w", compression=default) as zf:
        for member in members:
            with open(member.source, "rb") as src:
                size = os.fstat(src.fileno()).st_size
                method = default
                if not stored and not _worth_deflating(src, size):
                    method = zipfile.ZIP_STORED
                info = _zip_info(member.arcname, date_time, method)
                info.file_size = size  # lets zipfile pick zip64 up front
                with zf.open(info, "w") as dst:
                    digests[member.arcname] = _copy_hashing(src, dst, progress)
        body = replace(manifest, files=digests).to_bytes()
        zf.writestr(_zip_info(MANIFEST_PATH, date_time, default), body)
        if sign is not None:
            zf.writestr(_zip_info(SIGNATURE_PATH, date_time, default), sign(body, digests))
    return digests


def _tar_info(name: str, size: int, epoch: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = epoch
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _write_tgz(
    tmp: Path,
    members: Sequence[Member],
    manifest: Manifest,
    epoch: int,
    progress: Progress | None,
    sign: Sign | None = None,
) -> dict[str, FileDigest]:
    """Members go under a ``<model-name>/`` folder, the layout TorchServe's tgz loader expects."""
    top = manifest.model.model_name
    digests: dict[str, FileDigest] = {}
    with ExitStack() as stack:
        raw = stack.enter_context(open(tmp, "wb"))
        gz = stack.enter_context(
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=epoch, compresslevel=6)
        )
        tar = stack.enter_context(tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT))
        for member in members:
            with open(member.source, "rb") as src:
                size = os.fstat(src.fileno()).st_size
                reader = _HashingReader(src, progress)
                tar.addfile(
                    _tar_info(f"{top}/{member.arcname}", size, epoch), io.BufferedReader(reader)
                )
                digests[member.arcname] = FileDigest(reader.digest.hexdigest(), reader.size)
        body = replace(manifest, files=digests).to_bytes()
        tar.addfile(_tar_info(f"{top}/{MANIFEST_PATH}", len(body), epoch), io.BytesIO(body))
        if sign is not None:
            bundle = sign(body, digests)
            info = _tar_info(f"{top}/{SIGNATURE_PATH}", len(bundle), epoch)
            tar.addfile(info, io.BytesIO(bundle))
    return digests


def _write_folder(
    tmp: Path,
    members: Sequence[Member],
    manifest: Manifest,
    progress: Progress | None,
    sign: Sign | None = None,
) -> dict[str, FileDigest]:
    digests: dict[str, FileDigest] = {}
    tmp.mkdir()
    for member in members:
        dest = tmp / member.arcname
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(member.source, "rb") as src, open(dest, "wb") as dst:
            digests[member.arcname] = _copy_hashing(src, dst, progress)
    (tmp / "MAR-INF").mkdir(exist_ok=True)
    body = replace(manifest, files=digests).to_bytes()
    (tmp / MANIFEST_PATH).write_bytes(body)
    if sign is not None:
        (tmp / SIGNATURE_PATH).write_bytes(sign(body, digests))
    return digests


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _publish(tmp: Path, target: Path, force: bool) -> None:
    """Move the finished temp output onto ``target``; never replace it unless ``force``."""
    if tmp.is_dir():
        if target.exists() or target.is_symlink():
            if not force:
                raise OutputExists(str(target))
            trash = target.with_name(f".{target.name}.old-{secrets.token_hex(4)}")
            os.rename(target, trash)
            os.rename(tmp, target)
            _remove(trash)
        else:
            os.rename(tmp, target)
        return
    if force:
        if target.is_dir() and not target.is_symlink():
            _remove(target)
        os.replace(tmp, target)
        return
    try:
        os.link(tmp, target)  # atomic "create if absent": a concurrent winner makes this fail
    except FileExistsError:
        raise OutputExists(str(target)) from None
    tmp.unlink()


def write_archive(
    manifest: Manifest,
    members: Sequence[Member],
    export_dir: Path,
    fmt: ArchiveFormat,
    *,
    force: bool = False,
    progress: Progress | None = None,
    sign: Sign | None = None,
) -> Path:
    """Build the archive for ``manifest`` from ``members`` and return the published path.

    ``manifest.files`` is filled in here with the digests computed while writing; ``sign``
    signs them (and the manifest) into ``MAR-INF/signature.sigstore.json``.
    """
    target = target_path(export_dir, manifest.model.model_name, fmt)
    if not force and (target.exists() or target.is_symlink()):
        raise OutputExists(str(target))
    epoch = source_date_epoch()
    if epoch is not None:
        manifest = replace(manifest, created_on=created_on(epoch))
    stamp = epoch if epoch is not None else int(time.time())
    tmp = export_dir / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        if fmt is ArchiveFormat.TGZ:
            _write_tgz(tmp, members, manifest, stamp, progress, sign)
        elif fmt is ArchiveFormat.NO_ARCHIVE:
            _write_folder(tmp, members, manifest, progress, sign)
        else:
            stored = fmt is ArchiveFormat.ZIP_STORE
            _write_zip(tmp, members, manifest, stamp, stored, progress, sign)
        _publish(tmp, target, force)
    finally:
        if tmp.exists() or tmp.is_symlink():
            _remove(tmp)
    return target
