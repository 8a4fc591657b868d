"""Which idle model to evict: the one whose eviction costs least, not only the least recent.

Evicting a model costs its next load, and that cost comes as often as the model is asked for.
So the expected cost of evicting model m is ``rate(m) x reload_s(m)``: its request rate
(requests per second, exponentially decayed with a half-life of ``RATE_HALF_LIFE_S``, so a
model not asked for lately counts little, which keeps recency in the choice) times what bringing
it back takes, as measured (server/models/footprints.py): its wake time when the warm tier
would keep it, else its cold load time. A model that wakes in 0.05 s goes before one that takes
3 s to load and is asked for almost as often. Ties (two models never asked for since the
start, or no figures yet) fall back to least recently used. ``eviction: lru`` keeps plain LRU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

RATE_HALF_LIFE_S = 60.0
DEFAULT_RELOAD_S = 1.0  # a model never loaded on demand yet: what it would cost is unknown


class Asked(Protocol):
    @property
    def label(self) -> str: ...
    @property
    def asked(self) -> int: ...


class Rates:
    """Each model's request rate, from its ``asked`` counter read now and then (the
    residency chore, each eviction choice): no work on the request path but a counter."""

    def __init__(self, half_life_s: float = RATE_HALF_LIFE_S) -> None:
        self.tau_s = half_life_s / math.log(2)
        self._seen: dict[str, tuple[float, int, float]] = {}  # label: (when, count, decayed)

    def sample(self, models: Iterable[Asked], now: float) -> None:
        seen = {}
        for m in models:
            count = m.asked
            when, last, decayed = self._seen.get(m.label, (now, count, 0.0))
            decayed = decayed * math.exp(-(now - when) / self.tau_s) + (count - last)
            seen[m.label] = (now, count, decayed)
        self._seen = seen  # unregistered models go

    def rate(self, label: str, now: float) -> float:
        """Requests per second, decayed to ``now``."""
        when, _count, decayed = self._seen.get(label, (now, 0, 0.0))
        return decayed * math.exp(-(now - when) / self.tau_s) / self.tau_s
