"""A model's traffic policy, parsed at the edge: the split between its versions, the sticky key
and the canary plan, as the REST and gRPC management APIs, the model config's ``rollout:``
section and the snapshot give them. Past :func:`parse_policy` and :func:`parse_canary` there is
no dict: the router (server/rollouts/router.py) reads these frozen objects.

One policy per model *name*: it says which version a request that names no version gets. A
request that names its version always gets that version.

``shadow`` is filled by server/rollouts/shadow.py (the shadow of a share of the traffic onto
another version); this module only carries it, so a change of the split keeps the shadow and
the other way round (:func:`dataclasses.replace`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from mserve_worker.protocol import RequestItem
from server.errors import BadRequest
from server.models.batching import Job
from server.models.version import ModelVersion
from server.models.version_order import sorted_versions

# the most versions a split may name, and the longest sticky header or field name
MAX_SPLIT_VERSIONS = 16
MAX_KEY_NAME = 128
MAX_STEPS = 20


class Shadow(Protocol):
    """What server/rollouts/shadow.py puts in :attr:`Policy.shadow`: the router calls
    :meth:`send` right after a request of the model was queued on the version it picked."""

    def send(self, model: ModelVersion, item: RequestItem, job: Job) -> None: ...

    def shown(self) -> dict[str, Any]: ...

    def to_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Sticky:
    """Where a request's sticky key is read: a request header (matched case-insensitively) or
    a top-level field of a JSON request body. The same key always lands on the same version
    (weighted rendezvous hashing: a change of the weights moves only the keys it must)."""

    header: str | None = None  # lower-cased
    field: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"header": self.header} if self.header else {"field": self.field}


@dataclass(frozen=True)
class CanaryPlan:
    """A rollout of ``version`` over ``baseline``: the canary's share goes through ``steps``
    (percent), each held ``interval_s``; every ``window_s`` the canary's error ratio and p99
    latency are judged against the baseline's over the same window, and a breach rolls back."""

    version: str
    baseline: str
    steps: tuple[float, ...] = (5.0, 25.0, 50.0, 100.0)
    interval_s: float = 60.0
    window_s: float = 10.0
    # the canary's 5xx ratio may exceed the baseline's by this much (absolute)
    max_error_ratio: float = 0.01
    # the canary's p99 may be this many times the baseline's, unless under p99_floor_ms
    max_p99_ratio: float = 2.0
    p99_floor_ms: float = 20.0
    # and its median this many times the baseline's (the same floor): a version slower on
    # every request shows there first, where the baseline's p99 is its noise
    max_p50_ratio: float = 2.0
    # answers the canary needs in a window to be judged, and in a step to move on
    min_requests: int = 20

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "baseline": self.baseline,
            "steps": list(self.steps),
            "interval_s": self.interval_s,
            "window_s": self.window_s,
            "max_error_ratio": self.max_error_ratio,
            "max_p99_ratio": self.max_p99_ratio,
            "p99_floor_ms": self.p99_floor_ms,
            "max_p50_ratio": self.max_p50_ratio,
            "min_requests": self.min_requests,
        }


@dataclass(frozen=True)
class Policy:
    """A model name's traffic: ``weights`` (version -> weight, in percent; empty: the default
    version takes every request), ``sticky`` (None: each request drawn on its own), ``shadow``
    (server/rollouts/shadow.py; None: none). A running canary's weights replace ``weights``
    while it runs (server/rollouts/canary.py)."""

    weights: tuple[tuple[str, float], ...] = ()
    sticky: Sticky | None = None
    shadow: Shadow | None = field(default=None, compare=False)

    @property
    def empty(self) -> bool:
        return not self.weights and self.sticky is None and self.shadow is None

    def to_json(self) -> dict[str, Any]:
        return {
            "weights": dict(self.weights),
            "sticky": self.sticky.to_json() if self.sticky is not None else None,
        }


def parse_policy(doc: Any, versions: list[str], where: str = "body") -> Policy:
    """A split from its JSON/YAML form: ``{"weights": {"1.0": 90, "2.0": 10}, "sticky":
    {"header": "X-User"}}``. Weights are percent and add up to 100; each names a registered
    version (``versions``). ``where`` names the document in errors."""
    if not isinstance(doc, Mapping):
        raise BadRequest(f"{where}: expected an object with 'weights' and/or 'sticky'")
    unknown = set(doc) - {"weights", "sticky"}
    if unknown:
        raise BadRequest(
            f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}; expected"
            " 'weights' and/or 'sticky'"
        )
    return Policy(
        weights=parse_weights(doc.get("weights"), versions, f"{where}.weights"),
        sticky=parse_sticky(doc.get("sticky"), f"{where}.sticky"),
    )


def parse_weights(doc: Any, versions: list[str], where: str) -> tuple[tuple[str, float], ...]:
    if doc is None:
        return ()
    if not isinstance(doc, Mapping) or not doc:
        raise BadRequest(f"{where}: expected an object of version -> percent, such as"
                         ' {"1.0": 90, "2.0": 10}')  # fmt: skip
    if len(doc) > MAX_SPLIT_VERSIONS:
        raise BadRequest(f"{where}: {len(doc)} versions, more than {MAX_SPLIT_VERSIONS}")
    weights = []
    for version, weight in doc.items():
        version = str(version)
        if version not in versions:
            raise BadRequest(
                f"{where}: version {version!r} is not registered (registered:"
                f" {', '.join(sorted_versions(versions))})"
            )
        weights.append((version, _number(weight, f"{where}.{version}", 0.0, 100.0)))
    total = sum(w for _, w in weights)
    if abs(total - 100.0) > 1e-6:
        raise BadRequest(f"{where}: the weights add up to {total:g}, not 100")
    return tuple(weights)


def parse_sticky(doc: Any, where: str) -> Sticky | None:
    if doc is None:
        return None
    if not isinstance(doc, Mapping) or len(doc) != 1 or not set(doc) <= {"header", "field"}:
        raise BadRequest(
            f'{where}: expected {{"header": "<name>"}} or {{"field": "<name>"}} (exactly one)'
        )
    (kind, name), = doc.items()  # fmt: skip
    if not isinstance(name, str) or not name or len(name) > MAX_KEY_NAME:
        raise BadRequest(f"{where}.{kind}: expected a name of 1 to {MAX_KEY_NAME} characters")
    return Sticky(header=name.lower()) if kind == "header" else Sticky(field=name)


CANARY_FIELDS = frozenset(
    ("version", "baseline", "steps", "interval_s", "window_s", "max_error_ratio",
     "max_p99_ratio", "p99_floor_ms", "max_p50_ratio", "min_requests")
)  # fmt: skip


def parse_canary(doc: Any, versions: list[str], default: str, where: str = "body") -> CanaryPlan:
    """A canary plan from its JSON/YAML form (docs/rollouts.md); ``default``: the model's
    default version, the baseline unless the plan names one."""
    if not isinstance(doc, Mapping):
        raise BadRequest(f"{where}: expected an object with at least 'version'")
    unknown = set(doc) - CANARY_FIELDS
    if unknown:
        raise BadRequest(
            f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}; expected some"
            f" of {', '.join(sorted(CANARY_FIELDS))}"
        )
    if len(versions) < 2:
        raise BadRequest(
            f"{where}: a canary needs two versions of the model, and it has one"
            f" ({', '.join(sorted_versions(versions))}): register the new version first"
        )
    version = doc.get("version")
    if not isinstance(version, str) or not version:
        raise BadRequest(f"{where}.version: the canary's version is required")
    baseline = doc.get("baseline", default)
    for key, value in (("version", version), ("baseline", baseline)):
        if not isinstance(value, str) or value not in versions:
            raise BadRequest(
                f"{where}.{key}: version {value!r} is not registered (registered:"
                f" {', '.join(sorted_versions(versions))})"
            )
    if version == baseline:
        raise BadRequest(
            f"{where}.version: the canary {version!r} is the baseline itself; name another"
            " version, or the baseline with 'baseline'"
        )
    plan = CanaryPlan(version=version, baseline=baseline)
    steps = doc.get("steps", list(plan.steps))
    if not isinstance(steps, list) or not 1 <= len(steps) <= MAX_STEPS:
        raise BadRequest(f"{where}.steps: expected a list of 1 to {MAX_STEPS} percentages")
    parsed = tuple(_number(s, f"{where}.steps", 0.0, 100.0, above=True) for s in steps)
    if any(b <= a for a, b in itertools.pairwise(parsed)) or parsed[-1] != 100.0:
        raise BadRequest(
            f"{where}.steps: expected rising percentages ending at 100, got"
            f" {[float(s) for s in parsed]}"
        )
    bounds = {  # field: (low, high)
        "interval_s": (0.1, 86400.0),
        "window_s": (0.1, 3600.0),
        "max_error_ratio": (0.0, 1.0),
        "max_p99_ratio": (1.0, 1000.0),
        "p99_floor_ms": (0.0, 3_600_000.0),
        "max_p50_ratio": (1.0, 1000.0),
        "min_requests": (1.0, 1_000_000.0),
    }
    values = {
        key: _number(doc.get(key, getattr(plan, key)), f"{where}.{key}", low, high)
        for key, (low, high) in bounds.items()
    }
    return replace(plan, steps=parsed, **{**values, "min_requests": int(values["min_requests"])})


def _number(
    value: Any, where: str, low: float, high: float, above: bool = False
) -> float:  # fmt: skip
    """A finite number in [low, high] (``above``: > low)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"{where}: expected a number, got {value!r}")
    if value > high or value < low or (above and value == low):
        bound = f"more than {low:g}" if above else f"at least {low:g}"
        raise BadRequest(f"{where}: {value!r} is out of range ({bound}, at most {high:g})")
    return float(value)
