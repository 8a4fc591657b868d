"""Extraction safety: real malicious archives, built here with zipfile and tarfile, no mocks.

Every malicious archive carries a valid manifest, so each refusal is caused by the attack itself.
Every refusal checks the error class, the key text of its message, and that the destination's
parent folder is left empty (no destination, no ``.tmp-`` debris).
"""

from __future__ import annotations

import io
import json
import os
import random
import stat
import struct
import tarfile
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pytest

from archiver import (
    MANIFEST_PATH,
    ArchiveFormat,
    ArchiverError,
    BadArchive,
    DigestMismatch,
    ExtractLimits,
    InvalidManifest,
    LimitExceeded,
    Manifest,
    ModelInfo,
    UnsafeArchive,
    open_archive,
    write_archive,
)
from archiver.members import Member

MiB = 1 << 20
MODEL = {"modelName": "m", "handler": "h:handle", "modelVersion": "1.0"}
MANIFEST = json.dumps({"runtime": "python", "model": MODEL}).encode()
HANDLER = b"def handle(data, context):\n    return data\n"

# A member of a zip to write: a name (or a ZipInfo carrying mode bits) and its content.
ZipEntry = tuple[str | zipfile.ZipInfo, bytes]
# A member of a tar to write: (name, content) for a file, or a bare TarInfo for anything else.
TarEntry = tuple[str, bytes] | tarfile.TarInfo


def manifest_with(**model: object) -> bytes:
    return json.dumps({"runtime": "python", "model": {**MODEL, **model}}).encode()


def noise(n: int, seed: int = 0) -> bytes:
    """Incompressible, reproducible bytes."""
    return random.Random(seed).randbytes(n)


def make_zip(
    path: Path,
    entries: Iterable[ZipEntry] = (),
    *,
    manifest: bytes | None = MANIFEST,
    compression: int = zipfile.ZIP_DEFLATED,
) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile warns about duplicate names
        with zipfile.ZipFile(path, "w", compression) as zf:
            if manifest is not None:
                zf.writestr(MANIFEST_PATH, manifest)
            for name, data in entries:
                zf.writestr(name, data)
    return path


def make_tgz(
    path: Path, entries: Iterable[TarEntry] = (), *, manifest: bytes | None = MANIFEST
) -> Path:
    head: list[TarEntry] = [] if manifest is None else [(MANIFEST_PATH, manifest)]
    with tarfile.open(path, "w:gz", compresslevel=6) as tf:
        for entry in [*head, *entries]:
            if isinstance(entry, tarfile.TarInfo):
                tf.addfile(entry)
            else:
                name, data = entry
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def tar_entry(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info


def make_folder(
    path: Path, files: Mapping[str, bytes], *, manifest: bytes | None = MANIFEST
) -> Path:
    head = {} if manifest is None else {MANIFEST_PATH: manifest}
    for name, data in {**head, **files}.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


def rezip(
    src: Path,
    dst: Path,
    *,
    replace: Mapping[str, bytes] | None = None,
    add: Mapping[str, bytes] | None = None,
    drop: Iterable[str] = (),
) -> Path:
    """Copy a zip member by member, manifest unchanged, replacing, adding or dropping members."""
    replace, add, drop = replace or {}, add or {}, set(drop)
    with zipfile.ZipFile(src) as zf:
        kept = [(i.filename, zf.read(i)) for i in zf.infolist() if i.filename not in drop]
    changed = [(name, replace.get(name, data)) for name, data in kept]
    return make_zip(dst, [*changed, *add.items()], manifest=None)


# Header fields of one zip member: (offset in local header, offset in central header, format).
_ZIP_FIELDS = {
    "signature": (0, None, "<I"),
    "flags": (6, 8, "<H"),
    "method": (8, 10, "<H"),
    "crc": (14, 16, "<I"),
    "file_size": (22, 24, "<I"),
}


def patch_zip(
    path: Path, name: str, *, data_byte: tuple[int, int] | None = None, **fields: int
) -> Path:
    """Overwrite header fields of member ``name`` (local and central headers) and optionally one
    byte of its compressed data, given as (index, new value)."""
    with zipfile.ZipFile(path) as zf:
        local = zf.getinfo(name).header_offset
        central = zf.start_dir
    raw = bytearray(path.read_bytes())
    while True:  # walk the central directory to the member's entry
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", raw, central + 28)
        if raw[central + 46 : central + 46 + name_len] == name.encode():
            break
        central += 46 + name_len + extra_len + comment_len
    for field, value in fields.items():
        in_local, in_central, fmt = _ZIP_FIELDS[field]
        struct.pack_into(fmt, raw, local + in_local, value)
        if in_central is not None:
            struct.pack_into(fmt, raw, central + in_central, value)
    if data_byte is not None:
        index, value = data_byte
        raw[local + 30 + sum(struct.unpack_from("<HH", raw, local + 26)) + index] = value
    path.write_bytes(raw)
    return path


def assert_no_debris(parent: Path) -> None:
    assert sorted(p.name for p in parent.iterdir()) == []


def assert_refused(
    src: Path, error: type[ArchiverError], *texts: str, limits: ExtractLimits | None = None
) -> ArchiverError:
    """Open and extract ``src``; expect ``error`` naming every text, and nothing left behind."""
    parent = Path(tempfile.mkdtemp(prefix="out-", dir=src.parent))
    with pytest.raises(error) as caught, open_archive(src, limits) as archive:
        archive.extract(parent / "model")
    for text in texts:
        assert text in str(caught.value)
    assert_no_debris(parent)
    return caught.value


def assert_tree(root: Path, files: Mapping[str, bytes]) -> None:
    """``root`` holds exactly ``files`` (plus folders), byte for byte."""
    found = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert found == dict(files)


# --- 1, 2: paths that escape the target ---------------------------------------------------------

ESCAPES = [
    ("../evil.py", "escapes the target folder with '..'"),
    ("a/../../evil", "escapes the target folder with '..'"),
    ("/etc/evil", "has an absolute path"),
    ("C:/evil", "has an absolute path"),
    ("..\\evil", "uses '\\' in its path"),
]


@pytest.mark.parametrize(("name", "problem"), ESCAPES)
def test_zip_member_escaping_the_target_is_refused(tmp_path: Path, name: str, problem: str) -> None:
    src = make_zip(tmp_path / "evil.mar", [("h.py", HANDLER), (name, b"pwned")])
    error = assert_refused(src, UnsafeArchive, f"member '{name}'", problem)
    assert isinstance(error, UnsafeArchive) and error.member == name
    assert sorted(p.name for p in tmp_path.rglob("*evil*")) == ["evil.mar"]


@pytest.mark.parametrize(("name", "problem"), ESCAPES[:1] + ESCAPES[2:3])
def test_tgz_member_escaping_the_target_is_refused(tmp_path: Path, name: str, problem: str) -> None:
    src = make_tgz(tmp_path / "evil.tar.gz", [("h.py", HANDLER), (name, b"pwned")])
    assert_refused(src, UnsafeArchive, f"member '{name}'", problem)
    assert sorted(p.name for p in tmp_path.rglob("*evil*")) == ["evil.tar.gz"]


# --- 3: links, devices, FIFOs -------------------------------------------------------------------


def test_zip_symlink_member_is_refused(tmp_path: Path) -> None:
    link = zipfile.ZipInfo("link")
    link.create_system = 3
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    src = make_zip(tmp_path / "link.mar", [("h.py", HANDLER), (link, b"/etc/passwd")])
    assert_refused(src, UnsafeArchive, "member 'link'", "is a symbolic link")


@pytest.mark.parametrize(
    ("entry", "kind"),
    [
        (tar_entry("link", tarfile.SYMTYPE, "/etc/passwd"), "symbolic link"),
        (tar_entry("hard", tarfile.LNKTYPE, "h.py"), "hard link"),
        (tar_entry("tty", tarfile.CHRTYPE), "special file"),
        (tar_entry("fifo", tarfile.FIFOTYPE), "special file"),
    ],
    ids=["symlink", "hardlink", "chardev", "fifo"],
)
def test_tar_link_or_device_is_refused(tmp_path: Path, entry: tarfile.TarInfo, kind: str) -> None:
    src = make_tgz(tmp_path / "special.tar.gz", [("h.py", HANDLER), entry])
    assert_refused(src, UnsafeArchive, f"member '{entry.name}'", f"is a {kind}")


@pytest.mark.parametrize(
    ("plant", "kind"),
    [(lambda p: p.symlink_to("/etc/passwd"), "symbolic link"), (os.mkfifo, "special file")],
    ids=["symlink", "fifo"],
)
def test_folder_with_link_or_fifo_is_refused(
    tmp_path: Path, plant: Callable[[Path], None], kind: str
) -> None:
    src = make_folder(tmp_path / "model", {"h.py": HANDLER})
    plant(src / "odd")
    assert_refused(src, UnsafeArchive, "member 'odd'", f"is a {kind}")


# --- 4: duplicates ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second"),
    [("h.py", "h.py"), ("h.py", "./h.py"), ("pkg/a.py", "pkg//a.py"), ("pkg", "pkg/")],
)
def test_zip_member_appearing_twice_is_refused(tmp_path: Path, first: str, second: str) -> None:
    src = make_zip(tmp_path / "dup.mar", [(first, HANDLER), (second, b"evil = True\n")])
    assert_refused(src, UnsafeArchive, f"member '{second}'", "appears twice")


# --- 5, 6: bombs --------------------------------------------------------------------------------


def test_zip_bomb_is_refused_and_opens_when_the_ratio_is_raised(tmp_path: Path) -> None:
    src = make_zip(tmp_path / "bomb.mar", [("h.py", HANDLER), ("zeros.bin", bytes(64 * MiB))])
    error = assert_refused(src, LimitExceeded, "member 'zeros.bin'", "max_ratio=200", "zip bomb")
    assert isinstance(error, LimitExceeded) and error.limit == "max_ratio"
    assert "raise the 'max_ratio' limit" in str(error)
    with open_archive(src, ExtractLimits(max_ratio=10_000)) as archive:
        assert {m.name: m.size_bytes for m in archive.members}["zeros.bin"] == 64 * MiB


def test_tgz_bomb_is_refused(tmp_path: Path) -> None:
    src = make_tgz(tmp_path / "bomb.tar.gz", [("h.py", HANDLER), ("zeros.bin", bytes(64 * MiB))])
    error = assert_refused(src, LimitExceeded, "member 'zeros.bin'", "max_ratio=200")
    assert isinstance(error, LimitExceeded) and error.limit == "max_ratio"


# --- 7: counts and sizes ------------------------------------------------------------------------


TWENTY_FILES = {f"f{i}.txt": b"x" for i in range(20)}
THREE_KB = {f"f{i}.bin": noise(1000, i) for i in range(3)}


@pytest.mark.parametrize(
    ("files", "limit", "needed", "texts"),
    [
        (TWENTY_FILES, "max_members", 21, ["21 members"]),
        ({"h.py": HANDLER, "big.bin": noise(5000)}, "max_member_bytes", 5000, ["'big.bin'"]),
        (THREE_KB, "max_total_bytes", 3000 + len(MANIFEST), ["members add up"]),
    ],
    ids=["members", "member-bytes", "total-bytes"],
)
def test_limits_are_enforced_exactly(
    tmp_path: Path, files: dict[str, bytes], limit: str, needed: int, texts: list[str]
) -> None:
    """One below what the archive needs is refused; exactly what it needs opens."""
    src = make_zip(tmp_path / "many.mar", files.items())
    error = assert_refused(
        src,
        LimitExceeded,
        f"{limit}={needed - 1}",
        *texts,
        limits=ExtractLimits(**{limit: needed - 1}),
    )
    assert isinstance(error, LimitExceeded) and error.limit == limit
    with open_archive(src, ExtractLimits(**{limit: needed})) as archive:
        assert len(archive.members) == len(files) + 1


# --- 8: headers that lie, corrupt data ----------------------------------------------------------


@pytest.mark.parametrize(
    ("patch", "detail"),
    [({"file_size": 100}, "Bad CRC-32"), ({"data_byte": (0, 0x07)}, "invalid block type")],
    ids=["size-declared-smaller", "corrupt-deflate-stream"],
)
def test_corrupt_zip_member_is_bad_archive(tmp_path: Path, patch: dict, detail: str) -> None:
    """zipfile cuts a member off at its declared size, so a size lie surfaces as a CRC error."""
    src = make_zip(tmp_path / "lie.mar", [("h.py", HANDLER), ("data.bin", b"abcdefgh" * 512)])
    patch_zip(src, "data.bin", **patch)
    assert_refused(src, BadArchive, "member 'data.bin' is corrupt", detail)
    with open_archive(src) as archive:
        problems = archive.verify().problems
    assert len(problems) == 1 and "member 'data.bin' is corrupt" in problems[0]


def test_folder_member_growing_after_open_is_refused(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "model", {"h.py": HANDLER})
    parent = tmp_path / "out"
    parent.mkdir()
    with open_archive(src) as archive:
        with open(src / "h.py", "ab") as f:
            f.write(b"# grown after the scan\n")
        with pytest.raises(LimitExceeded, match=r"member 'h\.py' holds more bytes") as caught:
            archive.extract(parent / "model")
    assert caught.value.limit == "declared size"
    assert_no_debris(parent)


# --- 9: manifests -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("manifest", "field", "texts"),
    [
        (None, None, ["MAR-INF/MANIFEST.json is missing"]),
        (b"{not json", None, ["MAR-INF/MANIFEST.json", "not valid JSON"]),
        (json.dumps({"model": {"modelName": "m"}}).encode(), "model.handler", ["is missing"]),
        (manifest_with(modelName="bad name"), "model.modelName", ["'bad name'"]),
        (manifest_with(modelName="abc\n"), "model.modelName", ["not a valid model name"]),
    ],
    ids=["missing", "not-json", "no-handler", "bad-name", "name-with-newline"],
)
def test_invalid_manifest_is_refused(
    tmp_path: Path, manifest: bytes | None, field: str | None, texts: list[str]
) -> None:
    src = make_zip(tmp_path / "m.mar", [("h.py", HANDLER)], manifest=manifest)
    where = [f"field '{field}'"] if field else []
    error = assert_refused(src, InvalidManifest, *where, *texts)
    assert isinstance(error, InvalidManifest) and error.field == field


# --- 10: happy paths ----------------------------------------------------------------------------

GOOD = {
    MANIFEST_PATH: MANIFEST,
    "h.py": HANDLER,
    "weights.bin": noise(300_000),
    "pkg/__init__.py": b"VALUE = 1\n",
    "pkg/sub/vocab.txt": b"a\nb\n",
}


def build(fmt: str, tmp_path: Path) -> Path:
    files = {k: v for k, v in GOOD.items() if k != MANIFEST_PATH}
    if fmt == "zip":
        return make_zip(tmp_path / "m.mar", [("pkg/", b""), *files.items()])
    if fmt == "tgz":  # torch-model-archiver's layout: everything under one "m/" folder
        tops = [tar_entry("m", tarfile.DIRTYPE), ("m/" + MANIFEST_PATH, MANIFEST)]
        return make_tgz(
            tmp_path / "m.tar.gz",
            [*tops, *(("m/" + k, v) for k, v in files.items())],
            manifest=None,
        )
    return make_folder(tmp_path / "m", files)


@pytest.mark.parametrize("fmt", ["zip", "tgz", "folder"])
def test_good_archive_extracts_byte_identical(tmp_path: Path, fmt: str) -> None:
    src = build(fmt, tmp_path)
    parent = tmp_path / "out"
    with open_archive(src) as archive:
        assert archive.format == fmt
        assert archive.manifest.model.model_name == "m"
        assert archive.extract(parent / "model") == parent / "model"
    assert_tree(parent / "model", GOOD)
    assert sorted(p.name for p in parent.iterdir()) == ["model"]


def test_extract_into_existing_destination_is_refused(tmp_path: Path) -> None:
    src = build("zip", tmp_path)
    dest = tmp_path / "out" / "model"
    dest.mkdir(parents=True)
    (dest / "keep.txt").write_bytes(b"mine")
    with open_archive(src) as archive, pytest.raises(ArchiverError, match="already exists"):
        archive.extract(dest)
    assert_tree(dest, {"keep.txt": b"mine"})
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model"]


# --- 11: verify ---------------------------------------------------------------------------------


@pytest.fixture
def written(tmp_path: Path) -> Callable[[ArchiveFormat], Path]:
    """Write the model with ``archiver.write_archive`` in a given format."""
    sources = make_folder(
        tmp_path / "src", {"h.py": HANDLER, "weights.bin": noise(200_000)}, manifest=None
    )
    members = [Member(n, sources / n, "--test") for n in ("h.py", "weights.bin")]
    manifest = Manifest(model=ModelInfo(model_name="m", handler="h:handle"))

    def write(fmt: ArchiveFormat) -> Path:
        export = tmp_path / f"export-{fmt.value}"
        export.mkdir()
        return write_archive(manifest, members, export, fmt)

    return write


@pytest.mark.parametrize("fmt", list(ArchiveFormat), ids=lambda f: f.value)
def test_written_archive_verifies(
    written: Callable[[ArchiveFormat], Path], fmt: ArchiveFormat
) -> None:
    with open_archive(written(fmt)) as archive:
        report = archive.verify()
    assert report.ok, report.problems
    assert (report.checked, report.recorded) == (2, True)


def test_tampered_member_fails_verify_and_extract(
    tmp_path: Path, written: Callable[[ArchiveFormat], Path]
) -> None:
    src = rezip(written(ArchiveFormat.DEFAULT), tmp_path / "t.mar", replace={"h.py": b"evil()\n"})
    with open_archive(src) as archive:
        report = archive.verify()
    assert not report.ok
    assert len(report.problems) == 1 and report.problems[0].startswith("'h.py' sha256")
    assert_refused(src, DigestMismatch, "'h.py' does not match its recorded sha256")


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"add": {"extra.py": b"x = 1\n"}}, "'extra.py' is not listed in the manifest"),
        ({"drop": ["weights.bin"]}, "'weights.bin' is listed in the manifest but missing"),
    ],
    ids=["added", "dropped"],
)
def test_verify_reports_members_added_or_dropped(
    tmp_path: Path, written: Callable[[ArchiveFormat], Path], change: dict, problem: str
) -> None:
    src = rezip(written(ArchiveFormat.DEFAULT), tmp_path / "t.mar", **change)
    with open_archive(src) as archive:
        report = archive.verify()
    assert not report.ok
    assert len(report.problems) == 1 and report.problems[0].startswith(problem)


# --- damaged and unusual archives: clear errors, never raw library exceptions -------------------


def test_corrupt_manifest_member_is_bad_archive(tmp_path: Path) -> None:
    src = make_zip(tmp_path / "m.mar", [("h.py", HANDLER)])
    patch_zip(src, MANIFEST_PATH, crc=0)
    assert_refused(src, BadArchive, "MAR-INF/MANIFEST.json")


@pytest.mark.parametrize(
    "fields",
    [{"signature": 0}, {"method": 9}, {"flags": 1}],
    ids=["bad-local-header", "unsupported-method", "encrypted"],
)
def test_unreadable_zip_member_is_bad_archive(tmp_path: Path, fields: dict[str, int]) -> None:
    src = make_zip(tmp_path / "m.mar", [("h.py", HANDLER)], compression=zipfile.ZIP_STORED)
    patch_zip(src, "h.py", **fields)
    assert_refused(src, BadArchive, "member 'h.py'")


def test_file_and_folder_at_one_path_are_refused(tmp_path: Path) -> None:
    src = make_zip(tmp_path / "m.mar", [("a", b"file"), ("a/b", b"under the file")])
    assert_refused(src, UnsafeArchive, "member 'a/b'")


def test_tgz_with_dot_top_entry_opens(tmp_path: Path) -> None:
    src = make_tgz(
        tmp_path / "m.tar.gz",
        [tar_entry(".", tarfile.DIRTYPE), ("./" + MANIFEST_PATH, MANIFEST), ("./h.py", HANDLER)],
        manifest=None,
    )
    with open_archive(src) as archive:
        assert sorted(m.name for m in archive.members) == [MANIFEST_PATH, "h.py"]


def test_corrupt_tgz_is_bad_archive(tmp_path: Path) -> None:
    src = make_tgz(tmp_path / "m.tar.gz", [("h.py", HANDLER), ("weights.bin", noise(200_000))])
    raw = bytearray(src.read_bytes())
    raw[len(raw) // 2] ^= 0x55  # inside a stored deflate block: only the CRC can notice
    src.write_bytes(raw)
    assert_refused(src, BadArchive, "the gzip stream is corrupt")


def test_extract_refuses_member_not_listed_in_recorded_digests(
    tmp_path: Path, written: Callable[[ArchiveFormat], Path]
) -> None:
    hijack = {"h/__init__.py": b"def handle(data, context):\n    return 'hijacked'\n"}
    src = rezip(written(ArchiveFormat.DEFAULT), tmp_path / "t.mar", add=hijack)
    assert_refused(src, DigestMismatch, "'h/__init__.py'")
