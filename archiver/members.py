"""Turn the archiver's inputs into the list of files to pack, with their archive paths.

Rules (documented in docs/archiver.md): named files go to the archive root under their basename;
a folder given to ``--extra-files`` keeps its name and structure (``src/pkg`` -> ``pkg/...``) so
handlers can import packages from it; ``--model-path`` packs a folder's contents at the root.
Two different sources that land on the same archive path are an error, never a silent overwrite.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from archiver.errors import InputNotFound, UsageError
from archiver.manifest import MANIFEST_PATH

# What torch-model-archiver and MMS skip too: caches, VCS and other dot-folders, macOS debris.
_SKIP_DIRS = frozenset({"__pycache__", "__MACOSX"})
_SKIP_SUFFIXES = (".pyc", ".pyo", ".DS_Store")


@dataclass(frozen=True)
class Member:
    """One file to pack: its archive path, its source, and the flag that named it."""

    arcname: str
    source: Path
    origin: str


def _walk(folder: Path) -> Iterator[Path]:
    """Files under ``folder`` in a stable order, without caches and VCS folders."""
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if not name.endswith(_SKIP_SUFFIXES):
                yield Path(root) / name


def _folder_members(folder: Path, prefix: str, origin: str) -> Iterator[Member]:
    for path in _walk(folder):
        rel = path.relative_to(folder).as_posix()
        arcname = f"{prefix}/{rel}" if prefix else rel
        if arcname == MANIFEST_PATH:
            continue  # a previously unpacked archive: its old manifest is replaced
        yield Member(arcname, path, origin)


def split_list(values: Iterable[str]) -> list[str]:
    """``--extra-files`` takes comma-separated lists (TorchServe) and may be repeated."""
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def _expand(item: str) -> list[Path]:
    if glob.has_magic(item):
        matches = sorted(glob.glob(item, recursive=True))
        if not matches:
            raise InputNotFound("extra file pattern (no match)", item)
        return [Path(m) for m in matches]
    path = Path(item)
    if not path.exists():
        raise InputNotFound("extra file", item)
    return [path]


class MemberSet:
    """Collects members and rejects two sources claiming one archive path."""

    def __init__(self) -> None:
        self._by_name: dict[str, Member] = {}

    def add(self, member: Member) -> None:
        if member.arcname.startswith("MAR-INF/"):
            raise UsageError(
                f"{member.origin} {member.source} would be packed as {member.arcname}",
                hint="MAR-INF/ is reserved for the manifest",
            )
        seen = self._by_name.get(member.arcname)
        if seen is None:
            self._by_name[member.arcname] = member
        elif seen.source.resolve() != member.source.resolve():
            raise UsageError(
                f"two files would be packed as '{member.arcname}': {seen.source} ({seen.origin})"
                f" and {member.source} ({member.origin})",
                hint="rename one of them or put it in a folder",
            )

    def add_file(self, path: Path, origin: str) -> str:
        if not path.is_file():
            raise InputNotFound(origin.replace("--", "").replace("-", " "), str(path))
        self.add(Member(path.name, path, origin))
        return path.name

    def add_model_path(self, folder: Path) -> None:
        if not folder.is_dir():
            raise InputNotFound("--model-path folder", str(folder))
        for member in _folder_members(folder, "", "--model-path"):
            self.add(member)

    def add_folder(self, folder: Path, prefix: str, origin: str) -> None:
        if not folder.is_dir():
            raise InputNotFound(f"{origin} folder", str(folder))
        for member in _folder_members(folder, prefix, origin):
            self.add(member)

    def add_extra(self, items: Iterable[str]) -> None:
        for item in items:
            for path in _expand(item):
                if path.is_dir():
                    for member in _folder_members(path, path.resolve().name, "--extra-files"):
                        self.add(member)
                elif path.is_file():
                    self.add(Member(path.name, path, "--extra-files"))

    def names(self) -> set[str]:
        return set(self._by_name)

    def members(self) -> list[Member]:
        return [self._by_name[name] for name in sorted(self._by_name)]
