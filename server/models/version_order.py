"""The order in which a model's versions are listed to people: numbers as numbers, so that
``1.9`` comes before ``1.10`` and ``2.0`` before ``10.0`` (a version is any string TorchServe
accepts; its letters sort as text)."""

from __future__ import annotations

import re
from collections.abc import Iterable

_PARTS = re.compile(r"(\d+)")


def version_key(version: str) -> tuple[tuple[int, int, str], ...]:
    """Digit runs compare as numbers, the rest as text (a number sorts before text)."""
    return tuple(
        (0, int(part), "") if part.isdigit() else (1, 0, part)
        for part in _PARTS.split(version)
        if part
    )


def sorted_versions(versions: Iterable[str]) -> list[str]:
    return sorted(versions, key=version_key)
