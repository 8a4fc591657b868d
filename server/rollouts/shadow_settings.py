"""A model's shadow settings, parsed at the edge: the REST API, the model config's
``rollout:`` section and the snapshot give them as JSON/YAML; past :func:`parse_shadow` they
are a frozen :class:`ShadowSettings` (server/rollouts/shadow.py runs them)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from server.compare import CompareOptions
from server.errors import BadRequest
from server.models.version_order import sorted_versions

SHADOW_FIELDS = frozenset(
    ("version", "source", "share", "compare", "queue_size", "concurrency", "timeout_s", "samples")
)
MAX_QUEUE = 10_000
MAX_CONCURRENCY = 256
MAX_SAMPLES = 200


class ShadowControl(Protocol):
    """What the router (a model config's ``rollout.shadow``) and the management APIs call on
    server/rollouts/shadow_control.py's ``Shadows``; each raises BadRequest naming a bad
    field, ModelNotFound or PathNotFound."""

    def set(self, name: str, doc: Any, where: str = "body") -> Any: ...

    def inspect(self, name: str) -> dict[str, Any]: ...

    def put(self, name: str, doc: Any) -> dict[str, Any]: ...

    def delete(self, name: str) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ShadowSettings:
    """A model's shadow, as the operator set it (see the module docstring)."""

    version: str
    source: str | None = None  # None: the model's default version at the time
    share: float = 100.0
    compare: CompareOptions = field(default_factory=CompareOptions)
    queue_size: int = 100
    concurrency: int = 0
    timeout_s: float = 30.0
    samples: int = 20

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "source": self.source,
            "share": self.share,
            "compare": self.compare.to_dict(),
            "queue_size": self.queue_size,
            "concurrency": self.concurrency,
            "timeout_s": self.timeout_s,
            "samples": self.samples,
        }


def parse_shadow(
    doc: Any, versions: list[str], default: str, where: str = "body"
) -> ShadowSettings:
    """Settings from their JSON/YAML form, ``{"version": "2.0", "share": 100, "compare":
    {"abs_tol": 1e-6}}``; BadRequest names the field (``where`` the document)."""
    if not isinstance(doc, Mapping):
        raise BadRequest(f"{where}: expected an object with at least 'version'")
    unknown = set(doc) - SHADOW_FIELDS
    if unknown:
        raise BadRequest(
            f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}; expected some"
            f" of {', '.join(sorted(SHADOW_FIELDS))}"
        )
    version = doc.get("version")
    if not isinstance(version, str) or not version:
        raise BadRequest(f"{where}.version: the version to shadow onto is required")
    source = doc.get("source")
    for key, value in (("version", version), ("source", source)):
        if value is not None and (not isinstance(value, str) or value not in versions):
            raise BadRequest(
                f"{where}.{key}: version {value!r} is not registered (registered:"
                f" {', '.join(sorted_versions(versions))})"
            )
    if version == (source or default):
        what = "source" if source else "default version"
        raise BadRequest(
            f"{where}.version: a shadow of version {version!r} onto itself (it is the"
            f" {what}); name another version to shadow onto"
        )
    if doc.get("compare") is not None and not isinstance(doc["compare"], Mapping):
        raise BadRequest(f'{where}.compare: expected an object such as {{"abs_tol": 1e-6}}')
    try:
        options = CompareOptions.from_dict(doc.get("compare") or {}, prefix=f"{where}.compare.")
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    defaults = ShadowSettings(version)
    return ShadowSettings(
        version=version,
        source=source,
        share=_number(doc, "share", defaults.share, where, 0.0, 100.0, above=True),
        compare=options,
        queue_size=int(
            _number(doc, "queue_size", defaults.queue_size, where, 0, MAX_QUEUE, integer=True)
        ),
        concurrency=int(
            _number(
                doc, "concurrency", defaults.concurrency, where, 0, MAX_CONCURRENCY, integer=True
            )
        ),
        timeout_s=_number(doc, "timeout_s", defaults.timeout_s, where, 0.0, 3600.0, above=True),
        samples=int(_number(doc, "samples", defaults.samples, where, 0, MAX_SAMPLES, integer=True)),
    )


def _number(
    doc: Mapping[str, Any], key: str, default: float, where: str, low: float, high: float,
    above: bool = False, integer: bool = False,
) -> float:  # fmt: skip
    value = doc.get(key, default)
    kind = "an integer" if integer else "a number"
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or (integer and value != int(value))
    ):
        raise BadRequest(f"{where}.{key}: expected {kind}, got {value!r}")
    if value > high or value < low or (above and value == low):
        bound = f"more than {low:g}" if above else f"at least {low:g}"
        raise BadRequest(f"{where}.{key}: {value!r} is out of range ({bound}, at most {high:g})")
    return float(value)
