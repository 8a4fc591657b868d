"""A model name's route: its policy with what the request path reads, computed once per change
(the versions drawn from and their running totals), the requests each version was given, and
the sticky key's draw (weighted rendezvous hashing). server/rollouts/router.py owns them."""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import random

from mserve_worker.protocol import RequestItem
from server.rollouts.canary import Canary
from server.rollouts.policy import Policy, Sticky

_TWO_64 = float(1 << 64)


class Route:
    """A name's policy with what the hot path reads, computed once per change: the versions
    drawn from and their running totals, and the count of requests each version was given."""

    __slots__ = ("canary", "cumulative", "policy", "served", "sticky", "versions", "weights")

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.canary: Canary | None = None
        self.served: dict[str, int] = {}
        self.sticky: Sticky | None = policy.sticky
        self.versions: tuple[str, ...] = ()
        self.weights: tuple[float, ...] = ()
        self.cumulative: list[float] = []
        self.split(policy.weights)

    def split(self, weights: tuple[tuple[str, float], ...]) -> None:
        """Draw from ``weights`` from now on (zero weights never drawn)."""
        kept = [(v, w) for v, w in weights if w > 0]
        self.versions = tuple(v for v, _ in kept)
        self.weights = tuple(w for _, w in kept)
        total, self.cumulative = 0.0, []
        for w in self.weights:
            total += w
            self.cumulative.append(total)

    def current(self) -> tuple[tuple[str, float], ...]:
        return tuple(zip(self.versions, self.weights, strict=True))

    def draw(self) -> str:
        if len(self.versions) == 1:
            return self.versions[0]
        at = random.random() * self.cumulative[-1]
        return self.versions[min(bisect.bisect_right(self.cumulative, at), len(self.versions) - 1)]

    def by_key(self, key: bytes) -> str:
        """Weighted rendezvous hashing: each version scores the key, the highest wins. A key
        moves only when a weight change makes another version outscore its own, so raising a
        canary's weight moves keys onto it and none between the others."""
        best, best_score = self.versions[0], -math.inf
        for version, weight in zip(self.versions, self.weights, strict=True):
            digest = hashlib.blake2b(key, digest_size=8, person=_person(version)).digest()
            u = (int.from_bytes(digest, "big") + 0.5) / _TWO_64  # in (0, 1)
            score = -weight / math.log(u)
            if score > best_score:
                best, best_score = version, score
        return best


def _person(version: str) -> bytes:
    """A version's hash personalisation (blake2b takes at most 16 bytes)."""
    raw = version.encode()
    return raw if len(raw) <= 16 else hashlib.blake2b(raw, digest_size=16).digest()


def sticky_key(
    sticky: Sticky, item: RequestItem | None, meta: dict[str, str] | None
) -> bytes | None:
    """The request's sticky key, or None (drawn like a request without one)."""
    if sticky.header is not None:
        wanted = sticky.header
        if meta is not None:
            value = meta.get(wanted)
            return value.encode() if value else None
        if item is not None:
            for k, v in item.headers:
                if k.lower() == wanted:
                    return str(v).encode() if v else None
        return None
    if item is None or not item.body or "json" not in (item.content_type or "json"):
        return None
    try:
        doc = json.loads(bytes(item.body))
    except ValueError:
        return None
    value = doc.get(sticky.field) if isinstance(doc, dict) else None
    if value is None or isinstance(value, dict | list):
        return None
    return str(value).encode()
