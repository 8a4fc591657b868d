"""The folders of legacy checkpoints' mappable copies (server/models/warm.py): what a worker is
given, and what a sweep after a restart removes. In process, real folders (< 1 s); the
conversion itself is tested end to end in test_warm_tier.py."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from server.models.warm import WarmTier

MIB = 2**20


def test_a_worker_is_given_its_own_folder_and_may_write_only_there(tmp_path: Path) -> None:
    tier = WarmTier(64 * MIB, tmp_path / "unpacked")
    policy = {"read": ["/models/m"], "write": ["/scratch/m-1.0"]}
    init = tier.worker_init("m", "1.0", policy, None)
    folder = tmp_path / "unpacked" / "m-1.0.mapped"
    assert init == {"warm_tier": True, "mapped_dir": str(folder), "mapped_max_bytes": 64 * MIB}
    assert folder.is_dir() and oct(folder.stat().st_mode & 0o777) == "0o700"
    assert policy["write"] == ["/scratch/m-1.0", str(folder)]


def test_a_sweep_removes_the_copies_of_models_gone_since_an_earlier_run(tmp_path: Path) -> None:
    root = tmp_path / "unpacked"
    earlier = time.time() - 3600
    for name in ("gone-1.0.mapped", "kept-1.0.mapped", "fresh-2.0.mapped"):
        (root / name).mkdir(parents=True)
        (root / name / "weights.pt.0123456789abcdef01234567.pt").write_bytes(b"x")
        os.utime(root / name, (earlier, earlier))
    (root / "0123abcd").mkdir()  # an unpacked archive: never touched
    os.utime(root / "0123abcd", (earlier, earlier))
    tier = WarmTier(64 * MIB, root)
    tier.worker_init("fresh", "2.0", None, None)  # given to a worker of this run: in use
    asyncio.run(tier.sweep_copies([("kept", "1.0")]))
    assert sorted(p.name for p in root.iterdir()) == [
        "0123abcd", "fresh-2.0.mapped", "kept-1.0.mapped",
    ]  # fmt: skip


def test_the_copies_of_an_unregistered_model_go_with_it(tmp_path: Path) -> None:
    tier = WarmTier(64 * MIB, tmp_path / "unpacked")
    tier.worker_init("m", "1.0", None, None)
    asyncio.run(tier.remove_copies("m", "1.0"))
    assert not (tmp_path / "unpacked" / "m-1.0.mapped").exists()
