"""Open, verify and safely extract archives: zip ``.mar``, ``.tar.gz`` and unpacked folders.

An archive is untrusted input. Every member is checked before a byte is written: its path must
stay inside the target (no absolute paths, no ``..``, no backslashes, no duplicates), it must be a
plain file or folder (no links, devices, FIFOs), and counts, sizes and compression ratios must stay
under ``ExtractLimits``. Extraction writes into a private temp folder and renames it into place,
counting real bytes as they come out instead of trusting headers.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import secrets
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO

from archiver.errors import (
    ArchiverError,
    BadArchive,
    DigestMismatch,
    InvalidManifest,
    LimitExceeded,
    UnsafeArchive,
)
from archiver.manifest import MANIFEST_PATH, SIGNATURE_PATH, Manifest, parse

GiB = 1 << 30
# What reading a damaged or unsupported member raises (bad headers, CRC, truncation, an unknown
# compression method, encryption); turned into BadArchive at this one seam.
_UNREADABLE = (
    zipfile.BadZipFile,
    tarfile.TarError,
    EOFError,
    zlib.error,
    NotImplementedError,
    RuntimeError,
    OSError,
)
MAX_MANIFEST_BYTES = 1 << 20
_CHUNK_BYTES = 1 << 20
_RATIO_MIN_BYTES = 1 << 20  # small members compress well legitimately; judge ratios above this


@dataclass(frozen=True)
class ExtractLimits:
    """Bounds on what an archive may unpack to; raise them only for archives you trust."""

    max_members: int = 100_000
    max_member_bytes: int = 256 * GiB
    max_total_bytes: int = 512 * GiB
    max_ratio: float = 200.0


@dataclass(frozen=True)
class MemberInfo:
    name: str
    size_bytes: int
    compressed_bytes: int
    is_dir: bool = False


@dataclass(frozen=True)
class VerifyReport:
    """What verification found. ``recorded`` is False for archives without mserve digests."""

    checked: int
    recorded: bool
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_name(path: str, name: str) -> str:
    """Return the member's normalised relative path, or raise naming the problem."""
    if "\x00" in name:
        raise UnsafeArchive(path, name, "has a NUL byte in its name")
    if "\\" in name:
        raise UnsafeArchive(path, name, "uses '\\' in its path (only '/' is allowed)")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchive(path, name, "has an absolute path")
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(path, name, "escapes the target folder with '..'")
    return "/".join(parts)  # "" for the root folder entry ("." or "./")


class _Backend:
    """Format-specific access: list raw entries, open one member for reading."""

    def entries(self) -> Iterator[tuple[str, int, int, str]]:
        """Yield (raw name, size, compressed size, kind) where kind is file, dir or a type name."""
        raise NotImplementedError

    def open(self, raw_name: str) -> IO[bytes]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def check_stream(self) -> None:
        """Check integrity that only shows at the end of the whole file (gzip's CRC)."""


class _ZipBackend(_Backend):
    def __init__(self, path: Path) -> None:
        try:
            self._zf = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise BadArchive(str(path), f"not a readable zip file ({exc})") from exc

    def entries(self) -> Iterator[tuple[str, int, int, str]]:
        for info in self._zf.infolist():
            mode = info.external_attr >> 16
            if info.is_dir():
                kind = "dir"
            elif mode and stat.S_ISLNK(mode):
                kind = "symbolic link"
            elif mode and stat.S_IFMT(mode) not in (0, stat.S_IFREG):
                kind = "special file"
            else:
                kind = "file"
            yield info.filename, info.file_size, info.compress_size, kind

    def open(self, raw_name: str) -> IO[bytes]:
        return self._zf.open(raw_name)

    def close(self) -> None:
        self._zf.close()


class _TarBackend(_Backend):
    def __init__(self, path: Path) -> None:
        try:
            self._tf = tarfile.open(path, "r:*")  # noqa: SIM115  (closed by close())
            self._ordered = self._tf.getmembers()
            self._members = {m.name: m for m in self._ordered}
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise BadArchive(str(path), f"not a readable tar file ({exc})") from exc
        self._compressed = path.stat().st_size
        self._path = path

    def entries(self) -> Iterator[tuple[str, int, int, str]]:
        total = sum(m.size for m in self._ordered) or 1
        for m in self._ordered:
            if m.isdir():
                kind = "dir"
            elif m.issym() or m.islnk():
                kind = "symbolic link" if m.issym() else "hard link"
            elif not m.isreg():
                kind = "special file"
            else:
                kind = "file"
            # tar.gz compresses the stream, not members: attribute the file size pro rata
            yield m.name, m.size, max(1, self._compressed * m.size // total), kind

    def open(self, raw_name: str) -> IO[bytes]:
        fobj = self._tf.extractfile(self._members[raw_name])
        assert fobj is not None  # regular files only reach here
        return fobj

    def close(self) -> None:
        self._tf.close()

    def check_stream(self) -> None:
        # tarfile stops reading before the gzip trailer, so a flipped byte would go unnoticed
        with open(self._path, "rb") as raw:
            if raw.read(2) != b"\x1f\x8b":
                return
        try:
            with gzip.open(self._path) as stream:
                while stream.read(_CHUNK_BYTES):
                    pass
        except (OSError, EOFError, zlib.error) as exc:
            raise BadArchive(str(self._path), f"the gzip stream is corrupt ({exc})") from exc


class _FolderBackend(_Backend):
    def __init__(self, path: Path) -> None:
        self._root = path

    def entries(self) -> Iterator[tuple[str, int, int, str]]:
        for root, dirs, files in os.walk(self._root):
            dirs.sort()
            for name in sorted(dirs + files):
                p = Path(root) / name
                st = p.lstat()
                rel = p.relative_to(self._root).as_posix()
                if stat.S_ISLNK(st.st_mode):
                    yield rel, 0, 0, "symbolic link"
                elif stat.S_ISDIR(st.st_mode):
                    yield rel + "/", 0, 0, "dir"
                elif stat.S_ISREG(st.st_mode):
                    yield rel, st.st_size, st.st_size, "file"
                else:
                    yield rel, 0, 0, "special file"

    def open(self, raw_name: str) -> IO[bytes]:
        return open(self._root / raw_name, "rb")


def _backend_for(path: Path) -> tuple[str, _Backend]:
    if path.is_dir():
        return "folder", _FolderBackend(path)
    if not path.is_file():
        raise BadArchive(str(path), "no such file or folder")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] == b"PK":
        return "zip", _ZipBackend(path)
    if magic[:2] == b"\x1f\x8b" or tarfile.is_tarfile(path):
        return "tgz", _TarBackend(path)
    raise BadArchive(str(path), "not a zip (.mar), a .tar.gz or a folder")


class Archive:
    """An opened, checked archive. Use ``open_archive``; close it (or use ``with``)."""

    # where the manifest lies; a workflow archive's is elsewhere (archiver/workflow.py)
    manifest_path = MANIFEST_PATH
    kind = "a model archive"  # what a missing manifest says the file is not

    def __init__(self, path: Path, limits: ExtractLimits) -> None:
        self.path = path
        self.limits = limits
        self.format, self._backend = _backend_for(path)
        self.manifest_bytes = b""
        try:
            self._raw_names: dict[str, str] = {}
            self._members = self._scan()
            self.manifest = self._read_manifest()
        except BaseException:
            self._backend.close()
            raise

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._backend.close()

    @property
    def members(self) -> list[MemberInfo]:
        return list(self._members)

    def _scan(self) -> list[MemberInfo]:
        where = str(self.path)
        lim = self.limits
        raw = list(self._backend.entries())
        if len(raw) > lim.max_members:
            raise LimitExceeded(
                where, "max_members", f"{len(raw)} members, more than max_members={lim.max_members}"
            )
        names = [_check_name(where, name) for name, *_ in raw]
        prefix = self._common_top([n for n in names if n])
        out: list[MemberInfo] = []
        total = 0
        for (raw_name, size, packed, kind), name in zip(raw, names, strict=True):
            if kind not in ("file", "dir"):
                raise UnsafeArchive(
                    where, raw_name, f"is a {kind}; only files and folders are allowed"
                )
            rel = name[len(prefix) :] if prefix else name
            if not rel:
                if kind == "file":
                    raise UnsafeArchive(where, raw_name, "has an empty path")
                continue  # the root or top folder entry itself
            if rel in self._raw_names:
                raise UnsafeArchive(where, raw_name, "appears twice")
            self._raw_names[rel] = raw_name
            if size > lim.max_member_bytes:
                raise LimitExceeded(
                    where,
                    "max_member_bytes",
                    f"member '{raw_name}' is {size} bytes,"
                    f" more than max_member_bytes={lim.max_member_bytes}",
                )
            total += size
            if total > lim.max_total_bytes:
                raise LimitExceeded(
                    where,
                    "max_total_bytes",
                    f"members add up to more than max_total_bytes={lim.max_total_bytes}",
                )
            if size >= _RATIO_MIN_BYTES and size / max(packed, 1) > lim.max_ratio:
                raise LimitExceeded(
                    where,
                    "max_ratio",
                    f"member '{raw_name}' expands {size / max(packed, 1):.0f}x"
                    f" (max_ratio={lim.max_ratio:g}), a likely zip bomb",
                )
            out.append(MemberInfo(rel, size, packed, kind == "dir"))
        files = {m.name for m in out if not m.is_dir}
        for m in out:
            parts = m.name.split("/")
            for i in range(1, len(parts)):
                parent = "/".join(parts[:i])
                if parent in files:
                    raise UnsafeArchive(
                        where, self._raw_names[m.name], f"lies under '{parent}', which is a file"
                    )
        return out

    def _common_top(self, names: list[str]) -> str:
        """``x/`` when the manifest sits under one top folder (the tgz layout of TMA and MMS)."""
        if self.manifest_path in names:
            return ""
        tops = {n.split("/", 1)[0] for n in names}
        if len(tops) == 1:
            top = tops.pop()
            if f"{top}/{self.manifest_path}" in names:
                return f"{top}/"
        return ""

    def _corrupt(self, name: str, exc: BaseException) -> BadArchive:
        return BadArchive(str(self.path), f"member '{name}' is corrupt or unsupported ({exc})")

    @contextmanager
    def _reader(self, name: str) -> Iterator[Callable[[int], bytes]]:
        """A ``read(n)`` for one member; a failure to open or read it means a bad archive."""
        try:
            fobj = self._backend.open(self._raw_names[name])
        except _UNREADABLE as exc:
            raise self._corrupt(name, exc) from exc

        def read(n: int) -> bytes:
            try:
                return fobj.read(n)
            except _UNREADABLE as exc:
                raise self._corrupt(name, exc) from exc

        try:
            yield read
        finally:
            fobj.close()

    def _read_manifest(self) -> Manifest:
        where = f"{self.path}:{self.manifest_path}"
        if self.manifest_path not in self._raw_names:
            raise InvalidManifest(
                str(self.path), f"{self.manifest_path} is missing; not {self.kind}"
            )
        with self._reader(self.manifest_path) as read:
            raw = read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise InvalidManifest(where, f"larger than {MAX_MANIFEST_BYTES} bytes")
        self.manifest_bytes = raw  # what a signature covers (archiver/signing/)
        return self._parse_manifest(raw, where)

    def _parse_manifest(self, raw: bytes, where: str) -> Manifest:
        return parse(raw, where)

    def read_bytes(self, name: str, max_bytes: int = 16 << 20) -> bytes:
        """A small member's content (config, requirements), bounded."""
        if name not in self._raw_names:
            raise BadArchive(str(self.path), f"no member '{name}'")
        with self._reader(name) as read:
            data = read(max_bytes + 1)
        if len(data) > max_bytes:
            raise LimitExceeded(
                str(self.path), "max_bytes", f"member '{name}' is over {max_bytes} bytes"
            )
        return data

    def signature_bytes(self, max_bytes: int) -> bytes | None:
        """The signature bundle (``MAR-INF/signature.sigstore.json``), None when unsigned."""
        if SIGNATURE_PATH not in self._raw_names:
            return None
        return self.read_bytes(SIGNATURE_PATH, max_bytes)

    def _stream(self, name: str, sink: IO[bytes] | None, declared: int) -> str:
        """Copy one member to ``sink`` (or nowhere); return its sha256; refuse extra bytes.

        Read failures mean a bad archive; write failures (disk full) stay ``OSError``.
        """
        digest = hashlib.sha256()
        seen = 0
        with self._reader(name) as read:
            while chunk := read(_CHUNK_BYTES):
                seen += len(chunk)
                if seen > declared:
                    raise LimitExceeded(
                        str(self.path),
                        "declared size",
                        f"member '{name}' holds more bytes than its header declares ({declared})",
                    )
                digest.update(chunk)
                if sink is not None:
                    sink.write(chunk)
        return digest.hexdigest()

    def _files(self) -> dict[str, MemberInfo]:
        # the signature covers the others: the manifest cannot record it (archiver/signing/)
        unrecorded = (self.manifest_path, SIGNATURE_PATH)
        return {m.name: m for m in self._members if not m.is_dir and m.name not in unrecorded}

    def _unrecorded(self) -> list[str]:
        """Files the manifest's digests do not account for, both ways (empty without digests)."""
        recorded, files = self.manifest.files, self._files()
        if not recorded:
            return []
        return [
            *(
                f"'{n}' is not listed in the manifest (added after archiving?)"
                for n in files
                if n not in recorded
            ),
            *(
                f"'{n}' is listed in the manifest but missing from the archive"
                for n in recorded
                if n not in files
            ),
        ]

    def verify(self) -> VerifyReport:
        """Re-hash every member against the manifest; without digests, still read every byte."""
        problems: list[str] = []
        recorded = self.manifest.files
        files = self._files()
        for field_name, ref in self.manifest.referenced_files().items():
            if ref not in files:
                problems.append(f"model.{field_name} names '{ref}', which is not in the archive")
        for name, member in files.items():
            try:
                actual = self._stream(name, None, member.size_bytes)
            except ArchiverError as exc:
                problems.append(str(exc))
                continue
            want = recorded.get(name)
            if want is not None and (want.sha256 != actual or want.size_bytes != member.size_bytes):
                problems.append(
                    f"'{name}' sha256 {actual[:12]}... != recorded {want.sha256[:12]}..."
                )
        problems.extend(self._unrecorded())
        try:
            self._backend.check_stream()
        except ArchiverError as exc:
            problems.append(str(exc))
        return VerifyReport(checked=len(files), recorded=bool(recorded), problems=problems)

    def extract(self, dest: Path) -> Path:
        """Unpack into ``dest`` (which must not exist) via a temp folder renamed into place."""
        if dest.exists():
            raise ArchiverError(f"extraction target already exists: {dest}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        unrecorded = self._unrecorded()
        if unrecorded:
            raise DigestMismatch(str(self.path), unrecorded)
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            for member in self._members:
                target = tmp / member.name
                if member.is_dir:
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                with os.fdopen(fd, "wb") as sink:
                    actual = self._stream(member.name, sink, member.size_bytes)
                want = self.manifest.files.get(member.name)
                if want is not None and want.sha256 != actual:
                    raise DigestMismatch(
                        str(self.path), [f"'{member.name}' does not match its recorded sha256"]
                    )
            self._backend.check_stream()
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dest


def open_archive(path: Path | str, limits: ExtractLimits | None = None) -> Archive:
    """Open ``path`` (zip ``.mar``, ``.tar.gz`` or folder), check its members and manifest."""
    return Archive(Path(path), limits or ExtractLimits())
