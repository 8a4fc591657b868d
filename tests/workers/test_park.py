"""Parked workers, the worker's side: the PARK and PARKED frames byte for byte (docs/protocol.md,
Parked workers), and mserve_worker/park.py letting go of a real file mapping's pages and
mapping them again, measured in /proc/self/smaps, in this process."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from mserve_worker import park, protocol
from mserve_worker.protocol import Frame, Kind, Parked, ProtocolError
from tests.workers.test_protocol import decode_all

MIB = 2**20


def test_park_frame_bytes_match_the_docs() -> None:
    expected = bytes.fromhex("4d53 06 0e 0000 0000000d 00000000 0000") + b'{"park_id":3}'
    assert protocol.encode_bytes(protocol.park_frame(3)) == expected
    assert protocol.parse_park(decode_all(expected)[0]) == 3


def test_a_parked_answer_round_trips() -> None:
    answer = Parked(3, True, bytes=536870912, seconds=0.021)
    frame = protocol.parked_frame(answer)
    assert frame.meta == {"park_id": 3, "ok": True, "bytes": 536870912, "seconds": 0.021}
    assert protocol.parse_parked(decode_all(protocol.encode_bytes(frame))[0]) == answer
    refused = Parked(4, False, "cannot park: out of memory")
    assert protocol.parse_parked(protocol.parked_frame(refused)) == refused


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (Frame(Kind.PARK, {}), "PARK lacks the required field 'park_id'"),
        (Frame(Kind.PARK, {"park_id": -1}), "PARK park_id must be a non-negative integer, got -1"),
        (Frame(Kind.PARKED, {"park_id": 1, "ok": 1}), "PARKED ok must be true or false, got 1"),
        (Frame(Kind.PARKED, {"park_id": 1, "ok": False}),
         "PARKED lacks the required field 'error'"),
        (Frame(Kind.PARKED, {"park_id": 1, "ok": True, "seconds": -1}),
         "PARKED seconds must be a non-negative number, got -1"),
        (Frame(Kind.RESULT, {}), "expected a PARKED frame, got RESULT"),
    ],
)  # fmt: skip
def test_bad_park_frames_name_the_field(frame: Frame, message: str) -> None:
    parse = protocol.parse_park if frame.kind == Kind.PARK else protocol.parse_parked
    with pytest.raises(ProtocolError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(frame)


@pytest.fixture
def mapped(tmp_path: Path) -> Iterator[tuple[str, mmap.mmap]]:
    """A 16 MiB file mapped private and copy-on-write, as torch.load(mmap=True) maps weights,
    every page read."""
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(16 * MIB))
    with open(path, "rb") as f:
        view = mmap.mmap(
            f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    bytes(memoryview(view)[:: mmap.PAGESIZE])
    yield str(path), view
    view.close()


def _resident(path: str) -> int:
    """This process's resident bytes of its mappings of ``path`` (/proc/self/smaps)."""
    return sum(m.rss for m in psutil.Process().memory_maps(grouped=True) if m.path == path)


def test_parking_keeps_the_mapped_weights_and_what_the_handler_wrote(
    mapped: tuple[str, mmap.mmap],
) -> None:
    path, view = mapped
    view[0:1] = b"\x00" if view[0:1] != b"\x00" else b"\x01"  # a handler's write, kept
    before, resident = bytes(view[:8192]), _resident(path)
    parked = park.park(1, 16 * MIB)
    assert parked.ok and parked.bytes == 16 * MIB and parked.seconds >= 0
    # nothing let go: the next batch must not fault the weights in again
    assert _resident(path) >= resident > 15 * MIB
    assert bytes(view[:8192]) == before
