"""The types of a comparison: the answers, the options and the summary (see the package
docstring, server/compare/__init__.py, for the rules)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KINDS = (
    "status",
    "content_type",
    "bytes",
    "key",
    "type",
    "length",
    "value",
    "number",
    "top_k",
)

_MAX_TOP_K = 1000
_MAX_DIFFERENCES = 1000


@dataclass(frozen=True)
class Answer:
    """One answer as a client saw it: HTTP status, body bytes and content type."""

    status: int
    body: bytes
    content_type: str = ""


@dataclass(frozen=True)
class CompareOptions:
    """What counts as a difference. Defaults are strict: exact numbers, no top-k."""

    abs_tol: float = 0.0
    rel_tol: float = 0.0
    top_k: int = 0
    nan_equal: bool = True
    max_differences: int = 20

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], prefix: str = "") -> CompareOptions:
        """Options from an operator's mapping (JSON, YAML); ``ValueError`` names the field
        (with ``prefix``, e.g. ``shadow.``) and the value when one is wrong or unknown."""
        known = {"abs_tol", "rel_tol", "top_k", "nan_equal", "max_differences"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown field {prefix}{unknown[0]!s}: expected one of {', '.join(sorted(known))}"
            )
        values: dict[str, Any] = {}
        for name in ("abs_tol", "rel_tol"):
            if name in data:
                value = data[name]
                if (
                    isinstance(value, bool)
                    or not isinstance(value, int | float)
                    or not math.isfinite(value)
                    or value < 0
                ):
                    raise ValueError(f"{prefix}{name} must be a finite number >= 0, got {value!r}")
                values[name] = float(value)
        for name, top in (("top_k", _MAX_TOP_K), ("max_differences", _MAX_DIFFERENCES)):
            if name in data:
                value = data[name]
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
                    raise ValueError(
                        f"{prefix}{name} must be an integer from 0 to {top}, got {value!r}"
                    )
                values[name] = value
        if "nan_equal" in data:
            nan_equal = data["nan_equal"]
            if not isinstance(nan_equal, bool):
                raise ValueError(f"{prefix}nan_equal must be true or false, got {nan_equal!r}")
            values["nan_equal"] = nan_equal
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {
            "abs_tol": self.abs_tol,
            "rel_tol": self.rel_tol,
            "top_k": self.top_k,
            "nan_equal": self.nan_equal,
            "max_differences": self.max_differences,
        }


@dataclass(frozen=True)
class Difference:
    """One difference: where (a JSONPath), which kind, the two values quoted (JSON scalars or a
    short description of a container), the numbers' errors when numbers, and a detail."""

    path: str
    kind: str
    reference: Any = None
    candidate: Any = None
    abs_error: float | None = None
    rel_error: float | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "kind": self.kind}
        out["reference"] = self.reference
        out["candidate"] = self.candidate
        if self.kind == "number":
            out["abs_error"] = _finite_or_none(self.abs_error)
            out["rel_error"] = _finite_or_none(self.rel_error)
        if self.detail:
            out["detail"] = self.detail
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Difference:
        return cls(
            path=data["path"],
            kind=data["kind"],
            reference=data.get("reference"),
            candidate=data.get("candidate"),
            abs_error=_none_to_inf(data, "abs_error"),
            rel_error=_none_to_inf(data, "rel_error"),
            detail=data.get("detail", ""),
        )


@dataclass(frozen=True)
class TopKAgreement:
    """Rankings compared at top ``k``: how many had the same top-k label set, and the same
    first label."""

    k: int
    rankings: int
    agreed: int
    top1_agreed: int

    @property
    def agreement(self) -> float:
        return self.agreed / self.rankings if self.rankings else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "rankings": self.rankings,
            "agreed": self.agreed,
            "top1_agreed": self.top1_agreed,
            "agreement": self.agreement,
        }


@dataclass(frozen=True)
class Comparison:
    """The summary of one comparison (see the module docstring)."""

    equal: bool
    bytes_equal: bool
    kinds: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    differences: tuple[Difference, ...] = ()
    difference_count: int = 0
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    numbers_compared: int = 0
    top_k: TopKAgreement | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "equal": self.equal,
            "bytes_equal": self.bytes_equal,
            "kinds": list(self.kinds),
            "fields": list(self.fields),
            "differences": [d.to_dict() for d in self.differences],
            "difference_count": self.difference_count,
            "max_abs_error": _finite_or_none(self.max_abs_error),
            "max_rel_error": _finite_or_none(self.max_rel_error),
            "numbers_compared": self.numbers_compared,
            "top_k": self.top_k.to_dict() if self.top_k else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Comparison:
        top = data.get("top_k")
        return cls(
            equal=data["equal"],
            bytes_equal=data["bytes_equal"],
            kinds=tuple(data.get("kinds", ())),
            fields=tuple(data.get("fields", ())),
            differences=tuple(Difference.from_dict(d) for d in data.get("differences", ())),
            difference_count=data.get("difference_count", 0),
            max_abs_error=_none_to_inf(data, "max_abs_error") or 0.0,
            max_rel_error=_none_to_inf(data, "max_rel_error") or 0.0,
            numbers_compared=data.get("numbers_compared", 0),
            top_k=TopKAgreement(top["k"], top["rankings"], top["agreed"], top["top1_agreed"])
            if top
            else None,
        )


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _none_to_inf(data: Mapping[str, Any], key: str) -> float | None:
    if key not in data:
        return None
    value = data[key]
    return math.inf if value is None else float(value)
