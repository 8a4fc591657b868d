"""Archive throughput and peak memory: mserve's model-archiver against torch-model-archiver 0.12.

Usage: python scripts/bench_archive.py [--size-mb 1024] [--repeats 3]

The weights file holds float32 values drawn from a normal distribution (seed 0): a 4 MiB block
tiled to the requested size. Deflate's window is 32 KiB, so the tiling does not make it any more
compressible than real weights (both shrink about 7%). Each figure is the median of the repeats;
peak RSS is the archiving process's own (os.wait4), so the harness does not count.
"""

from __future__ import annotations

import argparse
import array
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from harness import BIN, REPO

BLOCK_FLOATS = 1 << 20
# where the archiver tests install it (tests/compat_tools.py), in a venv of its own
TMA_HOME = REPO / ".cache" / "compat" / "torch-model-archiver-0.12.0"


def make_weights(path: Path, size_bytes: int) -> None:
    rng = random.Random(0)
    block = array.array("f", (rng.gauss(0.0, 0.02) for _ in range(BLOCK_FLOATS))).tobytes()
    with open(path, "wb") as f:
        written = 0
        while written < size_bytes:
            chunk = block[: size_bytes - written]
            f.write(chunk)
            written += len(chunk)


def run_once(cmd: list[str], cwd: Path) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of one run of ``cmd``."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr.read().decode()}")  # type: ignore[union-attr]
    return elapsed, usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    ours = str(BIN / "model-archiver")
    tma = str(TMA_HOME / "bin" / "torch-model-archiver")
    if not Path(tma).exists():
        raise SystemExit(
            f"torch-model-archiver 0.12.0 is not installed in {TMA_HOME}: the archiver tests"
            f" install it there (pytest tests/archiver), or: python -m venv {TMA_HOME} &&"
            f" {TMA_HOME}/bin/pip install torch-model-archiver==0.12.0"
        )
    work = Path(tempfile.mkdtemp(prefix="bench-archive-", dir=Path.cwd()))
    try:
        weights = work / "weights.pt"
        make_weights(weights, args.size_mb << 20)
        (work / "handler.py").write_text("def handle(data, context):\n    return data\n")
        size = weights.stat().st_size
        common = ["--handler", "handler.py", "--serialized-file", "weights.pt", "-v", "1.0", "-f"]
        print(f"weights: {size / 1e6:.0f} MB float32, {args.repeats} runs each, median figures")
        print(
            f"{'tool':<22} {'format':<10} {'seconds':>8} {'MB/s':>7} {'peak RSS':>9} {'archive':>9}"
        )
        results: dict[tuple[str, str], float] = {}
        for fmt in ("default", "zip-store"):
            for label, exe in (("mserve model-archiver", ours), ("torch-model-archiver", tma)):
                times, peaks = [], []
                for _ in range(args.repeats):
                    t, peak = run_once(
                        [exe, "--model-name", "w", "--archive-format", fmt, *common], work
                    )
                    times.append(t)
                    peaks.append(peak)
                out = (work / "w.mar").stat().st_size
                secs = statistics.median(times)
                results[(label, fmt)] = secs
                print(
                    f"{label:<22} {fmt:<10} {secs:>8.2f} {size / secs / 1e6:>7.0f}"
                    f" {statistics.median(peaks) / 2**20:>6.0f} MiB {out / 1e6:>6.0f} MB"
                )
        for fmt in ("default", "zip-store"):
            ratio = results[("torch-model-archiver", fmt)] / results[("mserve model-archiver", fmt)]
            print(f"speed-up over torch-model-archiver, {fmt}: {ratio:.1f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
