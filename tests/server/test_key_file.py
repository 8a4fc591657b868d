"""token_key_file: fixed keys from a file (a Kubernetes Secret), so every replica behind one
Service takes the same key. The served behaviour (the key works, a wrong one is refused, no
rotation through the API) is tested end to end in tests/deploy/test_entry_command.py; here,
the file's format and every error about it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.auth import API, Keys, read_key_file
from server.errors import BadRequest, ConfigError

GOOD = "k" * 20


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "key_file.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_torchserves_layout_and_plain_strings_are_read(tmp_path: Path) -> None:
    """A key_file.json copied from a running server works as it is (expiry ignored)."""
    path = write(tmp_path, {
        "management": {"key": "m" * 20, "expiration time": "2026-01-01T00:00:00.000Z"},
        "inference": "i" * 20, "API": {"key": "a" * 20},
    })  # fmt: skip
    assert read_key_file(path) == {"management": "m" * 20, "inference": "i" * 20, API: "a" * 20}


def test_fixed_keys_never_expire_and_are_not_rotated(tmp_path: Path) -> None:
    now = [1000.0]
    keys = Keys(tmp_path / "out.json", {"inference": 60, "management": 60},
                clock=lambda: now[0], fixed={"inference": "i" * 20, "management": "m" * 20})  # fmt: skip
    now[0] += 10**9
    keys.check("inference", "i" * 20, "realm")  # still good, a billion seconds on
    with pytest.raises(BadRequest, match=r"the keys are fixed \(token_key_file\)"):
        keys.rotate("inference")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "is not valid JSON"),
        ([GOOD], "expected an object with 'inference' and 'management' keys"),
        ({"inference": GOOD}, "has no 'management' key"),
        ({"inference": GOOD, "management": 5}, "'management' should be a string or"),
        ({"inference": "short", "management": GOOD},
         "the 'inference' key has 5 characters; it should have 16 to 512"),
        ({"inference": GOOD, "management": "with space in it!!"},
         "the 'management' key should be printable ASCII without spaces"),
    ],
)  # fmt: skip
def test_bad_key_files_are_refused_naming_the_file(
    tmp_path: Path, content: object, message: str
) -> None:
    path = write(tmp_path, content)
    with pytest.raises(ConfigError, match=r"token_key_file .*key_file\.json") as info:
        read_key_file(path)
    assert message in str(info.value)


def test_a_missing_or_huge_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read token_key_file"):
        read_key_file(tmp_path / "absent.json")
    with pytest.raises(ConfigError, match="is larger than 65536 bytes"):
        read_key_file(write(tmp_path, " " * 70_000))
