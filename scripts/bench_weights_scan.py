"""Weights scan and SBOM figures (server/weights/, docs/weights-safety.md).

Usage: python scripts/bench_weights_scan.py [--gib 1.0] [--repeats 3]

Scan: a torch zip checkpoint (torch.save's format) and a legacy-format one of ``--gib`` GiB of
float32 tensors (16 tensors), and a plain pickle of one numpy array of 1/8 of that size: the
median seconds to scan each, per GiB, next to the seconds to read the file once (its sha256,
what registration already pays for an archive), and the scan's peak memory (picklescan reads
a torch zip's data.pkl and 8 bytes of each storage; a plain pickle's opcodes are read through,
and each object's bytes are read as one piece). The page cache is warm for both.

SBOM: cyclonedx-py against the server's python (what a default per-model environment lists,
the server's packages behind its own) and against an isolated environment with nothing but
pip; medians of the repeats.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from server.weights import sbom
from server.weights.scan import scan_file

TENSORS = 16


def read_once(path: Path) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def peak_rss_mib_of(code: str) -> float:
    """A fresh process's peak RSS running ``code`` (the scan alone, not this script's tensors)."""
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so it would be this process's
    out = subprocess.run([sys.executable, "-c", code + "\nprint(next(line for line in "
                          "open('/proc/self/status') if line.startswith('VmHWM')))"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return int(out.stdout.split()[-2]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    try:
        numel = int(args.gib * (1 << 30) / 4 / TENSORS)
        state = {f"layer{i}.weight": torch.ones(numel) for i in range(TENSORS)}
        files = {"torch zip": work / "zip.pt", "legacy torch": work / "legacy.pt",
                 "plain pickle": work / "plain.pkl"}  # fmt: skip
        torch.save(state, files["torch zip"])
        torch.save(state, files["legacy torch"], _use_new_zipfile_serialization=False)
        del state
        with open(files["plain pickle"], "wb") as f:
            pickle.dump({"w": np.ones(numel * 2, dtype=np.float32)}, f, protocol=5)
        print(f"scan (median of {args.repeats}; page cache warm)")
        print(f"{'file':14} {'GiB':>6} {'scan s':>8} {'s/GiB':>7} {'read s':>8} {'ratio':>6}"
              f" {'peak MiB':>9}")  # fmt: skip
        for kind, path in files.items():
            size_gib = path.stat().st_size / (1 << 30)
            read_once(path)  # into the page cache
            scan_s = median_s(lambda p=path: scan_file(p, p.name), args.repeats)
            read_s = median_s(lambda p=path: read_once(p), args.repeats)
            verdict = scan_file(path, path.name).verdict
            assert verdict == "clean", (kind, verdict)
            peak = peak_rss_mib_of(f"from pathlib import Path\nfrom server.weights.scan import "
                                   f"scan_file\nscan_file(Path({str(path)!r}), 'x')")  # fmt: skip
            print(f"{kind:14} {size_gib:6.2f} {scan_s:8.3f} {scan_s / size_gib:7.3f}"
                  f" {read_s:8.3f} {scan_s / read_s:6.2f} {peak:9.0f}")  # fmt: skip
        baseline = peak_rss_mib_of("from server.weights.scan import scan_file")
        print(f"(a process importing the scanner alone peaks at {baseline:.0f} MiB)")

        print(f"\nSBOM by cyclonedx-py (median of {args.repeats})")
        bare = work / "bare-env"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
        for label, python in (("server's python", sys.executable),
                              ("empty venv", str(bare / "bin" / "python"))):  # fmt: skip
            target = work / f"{label.replace(' ', '-')}.json"
            took = median_s(lambda py=python, t=target, lb=label: sbom.generate(py, t, lb),
                            args.repeats)  # fmt: skip
            count = len(json.loads(target.read_text()).get("components", []))
            print(f"{label:16} {count:4d} components {took:6.2f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
