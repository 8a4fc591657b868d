"""Tenants (docs/tenants.md): a key per client, a weight in each model's fair queue, quotas.

:data:`current` is the server's tenants (None: no ``tenants_file``, and nothing changes), set
once at start, read by the frontends and the model queues through this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from server.tenants.file import DEFAULT, Quota, TenantSpec, parse, read
from server.tenants.registry import QuotaExceeded, Tenant, Tenants, key_hash

__all__ = [
    "DEFAULT",
    "Quota",
    "QuotaExceeded",
    "Tenant",
    "TenantSpec",
    "Tenants",
    "current",
    "key_hash",
    "parse",
    "read",
    "setup",
]

current: Tenants | None = None


def setup(path: Path, known_models: Callable[[], Iterable[str]]) -> Tenants:
    """Read the tenants file (a mistake raises ConfigError: the start fails) and make it the
    server's; before any model version is made, since their queues are fair ones from then."""
    global current
    current = Tenants(path, known_models)
    return current
