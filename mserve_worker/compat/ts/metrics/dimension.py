"""TorchServe's ``ts.metrics.dimension``: a metric's ``name: value`` label."""

from __future__ import annotations

from typing import Any


class Dimension:
    """One label of a metric; ``context.metrics`` takes a list of these as ``dimensions``."""

    def __init__(self, name: str, value: Any) -> None:
        self.name = name
        self.value = value

    def __str__(self) -> str:
        return f"{self.name}:{self.value}"

    def __repr__(self) -> str:
        return f"Dimension({self.name!r}, {self.value!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Dimension):
            return NotImplemented
        return (self.name, self.value) == (other.name, other.value)

    def __hash__(self) -> int:
        return hash((self.name, str(self.value)))

    def to_dict(self) -> dict[str, Any]:
        return {"Name": self.name, "Value": self.value}
