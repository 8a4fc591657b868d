"""Parked workers, the worker's side: the PARK and PARKED frames byte for byte (docs/protocol.md,
Parked workers), and mserve_worker/park.py letting go of a real file mapping's pages and
mapping them again, measured in /proc/self/smaps, in this process."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mserve_worker import park, protocol
from mserve_worker.protocol import Frame, Kind, Parked, ProtocolError
from tests.workers.test_protocol import decode_all

MIB = 2**20


def test_park_frame_bytes_match_the_docs() -> None:
    expected = bytes.fromhex("4d53 06 0e 0000 0000001b 00000000 0000") + (
        b'{"park_id":3,"step":"park"}'
    )
    assert protocol.encode_bytes(protocol.park_frame(3, "park")) == expected
    assert protocol.parse_park(decode_all(expected)[0]) == (3, "park")


def test_a_parked_answer_round_trips() -> None:
    answer = Parked(3, "park", True, bytes=536870912, seconds=0.021)
    frame = protocol.parked_frame(answer)
    assert frame.meta == {"park_id": 3, "step": "park", "ok": True, "bytes": 536870912,
                          "seconds": 0.021}  # fmt: skip
    assert protocol.parse_parked(decode_all(protocol.encode_bytes(frame))[0]) == answer
    refused = Parked(4, "park", False, "the handler wrote to its mapped weights")
    assert protocol.parse_parked(protocol.parked_frame(refused)) == refused


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (Frame(Kind.PARK, {"step": "park"}), "PARK lacks the required field 'park_id'"),
        (Frame(Kind.PARK, {"park_id": 1, "step": "sleep"}),
         "PARK step must be one of park, wake, got 'sleep'"),
        (Frame(Kind.PARKED, {"park_id": 1, "step": "park", "ok": 1}),
         "PARKED ok must be true or false, got 1"),
        (Frame(Kind.PARKED, {"park_id": 1, "step": "wake", "ok": False}),
         "PARKED lacks the required field 'error'"),
        (Frame(Kind.PARKED, {"park_id": 1, "step": "park", "ok": True, "seconds": -1}),
         "PARKED seconds must be a non-negative number, got -1"),
        (Frame(Kind.RESULT, {}), "expected a PARKED frame, got RESULT"),
    ],
)  # fmt: skip
def test_bad_park_frames_name_the_field(frame: Frame, message: str) -> None:
    parse = protocol.parse_park if frame.kind == Kind.PARK else protocol.parse_parked
    with pytest.raises(ProtocolError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(frame)


def _resident(path: str) -> int:
    """This process's resident bytes of its mappings of ``path`` (/proc/self/smaps)."""
    return sum(rss for _s, _e, rss, _anon in park._mappings({path}))


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


@pytest.mark.skipif(not park.supported(), reason="parking needs Linux's /proc/self/smaps")
def test_parking_lets_go_of_the_pages_and_waking_maps_them_again(
    mapped: tuple[str, mmap.mmap],
) -> None:
    path, view = mapped
    before = bytes(view[:4096]) + bytes(view[-4096:])
    assert _resident(path) > 15 * MIB
    parked = park.step(1, protocol.PARK, [path])
    assert parked.ok, parked.error
    assert parked.bytes > 15 * MIB and _resident(path) < 1 * MIB
    woken = park.step(2, protocol.WAKE, [path])
    assert woken.ok and woken.bytes == 16 * MIB
    assert _resident(path) > 15 * MIB
    assert bytes(view[:4096]) + bytes(view[-4096:]) == before  # the file's bytes, unchanged


@pytest.mark.skipif(not park.supported(), reason="parking needs Linux's /proc/self/smaps")
def test_a_mapping_written_to_is_not_parked(mapped: tuple[str, mmap.mmap]) -> None:
    path, view = mapped
    view[0:1] = b"\x00" if view[0:1] != b"\x00" else b"\x01"  # a private copy of that page
    written, resident = view[0:1], _resident(path)
    answer = park.step(1, protocol.PARK, [path])
    assert not answer.ok and "the handler wrote to its mapped weights (4 KiB" in answer.error
    assert view[0:1] == written and _resident(path) >= resident  # nothing dropped


def test_nothing_mapped_is_not_parked(tmp_path: Path) -> None:
    answer = park.step(1, protocol.PARK, [str(tmp_path / "absent.pt")])
    assert not answer.ok and "none of the model's mapped weights is mapped" in answer.error
