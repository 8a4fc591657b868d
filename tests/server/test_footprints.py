"""The measured footprints file (server/models/footprints.py): what a restart reads back, and a
file it cannot use. The server side is in tests/server/test_warm_tier.py."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from server.models.footprints import FOOTPRINTS_FILE, Footprints


def test_footprints_written_are_read_back_by_the_next_start(tmp_path: Path) -> None:
    first = Footprints(tmp_path)
    first.worker("big:1.0", 1200 * 2**20)
    first.loaded("big:1.0", 7.3141, warm=False)
    first.loaded("big:1.0", 0.41, warm=True)
    first.warm("big:1.0", 1024 * 2**20)
    asyncio.run(first.save())
    again = Footprints(tmp_path).get("big:1.0")
    assert (again.worker_bytes, again.warm_bytes) == (1200 * 2**20, 1024 * 2**20)
    assert (again.load_s, again.wake_s) == (7.3141, 0.41)
    assert again.reload_s(warm=True) == 0.41 and again.reload_s(warm=False) == 7.3141
    assert Footprints(tmp_path).get("other:1.0").worker_bytes is None


def test_an_unusable_footprints_file_is_named_and_measured_anew(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / FOOTPRINTS_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert Footprints(tmp_path).get("big:1.0").worker_bytes is None
    assert f"{tmp_path / FOOTPRINTS_FILE} is unreadable" in caplog.text
    assert "model footprints are measured anew" in caplog.text
    entry = {"worker_bytes": -5, "load_s": 1.0}
    (tmp_path / FOOTPRINTS_FILE).write_text(
        json.dumps({"schema": 1, "models": {"bad:1.0": entry, "ok:1.0": {"load_s": 2.5}}})
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        kept = Footprints(tmp_path)
    assert "ignoring the entry of bad:1.0 (negative size -5)" in caplog.text
    assert kept.get("bad:1.0").load_s is None and kept.get("ok:1.0").load_s == 2.5
