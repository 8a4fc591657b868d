"""The unpack cache: an archive unpacked and checked once is not opened or checked again while
the manifest schema is the same (a restart's startup models skip importing the validator)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from archiver import MANIFEST_PATH, schema_digest
from server.errors import DigestMismatch
from server.store import CHECKED_SUFFIX, unpack
from tests.conftest import ArchiverRunner


def _archive(run_archiver: ArchiverRunner, tmp_path: Path) -> Path:
    (tmp_path / "h.py").write_text("def handle(data, context):\n    return data\n")
    result = run_archiver("--model-name", "m", "--handler", "h.py", "--export-path", ".")
    assert result.exit_code == 0, result.output
    return tmp_path / "m.mar"


def _edit_cached_manifest(model_dir: Path, description: str) -> None:
    """What only a read of the unpacked folder can see (the archive says otherwise)."""
    path = model_dir / MANIFEST_PATH
    data = json.loads(path.read_text())
    data["model"]["description"] = description
    path.write_text(json.dumps(data))


def test_a_second_unpack_reads_the_checked_manifest_from_the_cache(
    archiver: ArchiverRunner, tmp_path: Path
) -> None:
    mar = _archive(archiver, tmp_path)
    cache = tmp_path / "unpacked"
    first = unpack(mar, "m.mar", cache)
    assert first.manifest.model.model_name == "m"
    marker = cache / f"{first.sha256}{CHECKED_SUFFIX}"
    assert json.loads(marker.read_text()) == {"schema": schema_digest()}
    _edit_cached_manifest(first.model_dir, "read from the cache")
    again = unpack(mar, "m.mar", cache)
    assert again.model_dir == first.model_dir and again.sha256 == first.sha256
    assert again.manifest.model.description == "read from the cache"


@pytest.mark.parametrize("marker_text", ['{"schema": "another schema"}', None, "not json"])
def test_without_a_marker_for_this_schema_the_archive_is_checked_again(
    archiver: ArchiverRunner, tmp_path: Path, marker_text: str | None
) -> None:
    mar = _archive(archiver, tmp_path)
    cache = tmp_path / "unpacked"
    first = unpack(mar, "m.mar", cache)
    _edit_cached_manifest(first.model_dir, "read from the cache")
    marker = cache / f"{first.sha256}{CHECKED_SUFFIX}"
    if marker_text is None:
        marker.unlink()
    else:
        marker.write_text(marker_text)
    again = unpack(mar, "m.mar", cache)
    assert again.manifest.model.description != "read from the cache"  # the archive's own
    assert json.loads(marker.read_text()) == {"schema": schema_digest()}


def test_a_pinned_digest_is_checked_before_the_cache_is_used(
    archiver: ArchiverRunner, tmp_path: Path
) -> None:
    mar = _archive(archiver, tmp_path)
    cache = tmp_path / "unpacked"
    first = unpack(mar, "m.mar", cache)
    with pytest.raises(DigestMismatch, match=f"its sha256 is {first.sha256}, the sha256 param"):
        unpack(mar, "m.mar", cache, pin="0" * 64)


def test_concurrent_unpacks_of_one_archive_all_get_the_folder(
    archiver: ArchiverRunner, tmp_path: Path
) -> None:
    """Two models registered at once from the same bytes (startup models, or one archive under
    two names): the one that loses the race uses the winner's folder, and never removes it."""
    mar = _archive(archiver, tmp_path)
    for attempt in range(5):
        cache = tmp_path / f"unpacked{attempt}"
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(unpack, [mar] * 8, ["m.mar"] * 8, [cache] * 8))
        assert {r.model_dir for r in results} == {results[0].model_dir}
        assert (results[0].model_dir / MANIFEST_PATH).is_file()
