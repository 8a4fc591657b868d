"""server/models/file_map.py: the warm tier's mappings, made with the GIL released, and what a
process's mappings of given files hold."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest

from server.models.file_map import held, map_file, total_pss

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: Linux")

MIB = 2**20


def _mapping_rss(path: Path) -> int | None:
    """The resident bytes of this process's mapping of ``path`` (/proc/self/smaps), None when
    it is not mapped."""
    rss, found = 0, False
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header
            current = fields[5] if len(fields) > 5 else None
        elif current == str(path) and fields[0] == "Rss:":
            rss += int(fields[1]) * 1024
            found = True
    return rss if found else None


def test_a_file_is_mapped_whole_with_its_pages_mapped_and_unmapped_on_close(
    tmp_path: Path,
) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(3 * MIB + 123))
    mapping = map_file(str(path))
    assert mapping is not None
    try:
        # MAP_POPULATE: every page of the file is in this process's page tables at once
        # (the warm tier counts them in its budget and the kernel keeps them cached)
        rss = _mapping_rss(path)
        assert rss is not None and rss >= 3 * MIB
    finally:
        mapping.close()
    assert _mapping_rss(path) is None
    mapping.close()  # closing twice is harmless: a drop and a stop may both close


def test_an_empty_file_has_nothing_to_map_and_a_missing_one_says_so(tmp_path: Path) -> None:
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert map_file(str(empty)) is None
    with pytest.raises(FileNotFoundError):
        map_file(str(tmp_path / "gone.bin"))


def test_a_mapping_forgotten_is_unmapped_when_collected(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(MIB))
    mapping = map_file(str(path))
    assert _mapping_rss(path) is not None
    del mapping  # never closed: a path that loses an entry must not leak its mapping
    assert _mapping_rss(path) is None


def test_what_a_process_maps_of_its_files_reads_as_psutil_reads_it(tmp_path: Path) -> None:
    """held() finds the paths' blocks in /proc/<pid>/smaps instead of parsing all of it (the
    warm tier reads a parked worker's every 5 s): the same figures as psutil's full parse."""
    paths = [tmp_path / "a.bin", tmp_path / "b c.bin"]  # a space in a path, too
    for path in paths:
        path.write_bytes(os.urandom(2 * MIB))
    mappings = [map_file(str(p)) for p in paths]
    twice = map_file(str(paths[0]))  # two mappings of one file: summed
    try:
        got = held("self", [str(p) for p in paths] + [str(tmp_path / "never-mapped.bin")])
        theirs = {m.path: m for m in psutil.Process().memory_maps(grouped=True)}
        assert set(got) == {str(p) for p in paths}
        for path in paths:
            assert got[str(path)].rss == theirs[str(path)].rss
            assert got[str(path)].pss == theirs[str(path)].pss
            assert got[str(path)].anonymous == theirs[str(path)].anonymous == 0
        assert got[str(paths[0])].rss == 2 * got[str(paths[1])].rss  # mapped twice
        assert held(os.getpid(), [str(paths[1])])[str(paths[1])].rss == 2 * MIB
    finally:
        for mapping in (*mappings, twice):
            assert mapping is not None
            mapping.close()
    assert held("self", [str(p) for p in paths]) == {}


def test_a_process_total_pss_and_a_gone_one() -> None:
    ours = total_pss("self")
    theirs = psutil.Process().memory_full_info().pss
    assert 0.8 * theirs < ours < 1.25 * theirs  # read moments apart: the heap moves a little
    with pytest.raises(FileNotFoundError):
        held(2**22 + 12345, ["/x"])  # beyond pid_max: no such process
