"""Archiving big weights streams: peak memory stays flat however large the file is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from archiver import ExtractLimits, open_archive

SPARSE_BYTES = 1 << 30  # 1 GiB: far more than the memory bound below
PEAK_RSS_LIMIT_BYTES = 150 << 20

# VmHWM is this process image's own peak. ru_maxrss would not do: Linux carries it over from the
# forked parent, here pytest, which holds torch once the model tests are collected.
_MEASURE = """
import sys
from archiver.cli import main
code = None
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
with open("/proc/self/status") as status:
    peak_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
print(peak_kib * 1024, code)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["zip-store", "default", "tgz"])
def test_large_sparse_file_streams(tmp_path: Path, fmt: str) -> None:
    weights = tmp_path / "big.pt"
    with open(weights, "wb") as f:
        f.truncate(SPARSE_BYTES)
    (tmp_path / "h.py").write_text("def handle(data, context):\n    return data\n")
    args = ["--model-name", "big", "--handler", "h.py", "--serialized-file", "big.pt"]
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, *args, "--archive-format", fmt],
        cwd=tmp_path, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    peak, code = out.stdout.split()[-2:]
    assert code in ("0", "None"), out.stderr
    assert int(peak) < PEAK_RSS_LIMIT_BYTES, f"peak RSS {int(peak) >> 20} MiB"
    name = "big.tar.gz" if fmt == "tgz" else "big.mar"
    # zeros compress ~1000x: a legitimate archive that the bomb guard would flag by default
    with open_archive(tmp_path / name, ExtractLimits(max_ratio=1e6)) as archive:
        (member,) = [m for m in archive.members if m.name == "big.pt"]
        assert member.size_bytes == SPARSE_BYTES
        assert archive.manifest.files["big.pt"].size_bytes == SPARSE_BYTES
