"""The server's shadows (docs/shadow.md): one per model name at most, kept in the router's
policies (``Policy.shadow``, server/rollouts/shadow.py runs each); this module makes them from
the operator's settings (REST, gRPC, a model config's ``rollout.shadow``), puts them back from
the snapshot, ends one whose version goes, and owns their metrics."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from prometheus_client import Counter

from server.errors import BadRequest, PathNotFound
from server.metrics.server_metrics import Metrics
from server.models.registry import Registry
from server.rollouts.router import Router
from server.rollouts.shadow import Shadow
from server.rollouts.shadow_settings import parse_shadow

log = logging.getLogger(__name__)


class Shadows:
    """The server's shadows, one per model name at most, kept in the router's policies
    (``Policy.shadow``): built from the operator's settings, put back from the snapshot, and
    taken off when their version goes away. One per server, made beside the router."""

    def __init__(self, router: Router, registry: Registry, metrics: Metrics | None = None) -> None:
        self.router = router
        self.registry = registry
        self._counters: tuple[Counter, Counter] | None = None
        if metrics is not None:
            self._counters = (
                Counter(
                    "mserve_shadow_requests", "Shadowed requests by outcome (version: the shadow)",
                    ["model", "version", "outcome"], registry=metrics.prom,
                ),
                Counter(
                    "mserve_shadow_differences",
                    "Shadow answers that differed from the client's, by kind of difference",
                    ["model", "version", "kind"], registry=metrics.prom,
                ),
            )  # fmt: skip
        router.on_restore_shadow(self.restore)
        router.shadows = self  # where the management API finds it (server/rest/rollouts.py)
        # after the router's own listener, before the snapshot's (server/lifecycle.py)
        registry.on_change("shadows", self._prune)

    def get(self, name: str) -> Shadow | None:
        shadow = self.router.policy(name).shadow
        return shadow if isinstance(shadow, Shadow) else None

    def build(self, name: str, doc: Any, where: str = "body") -> Shadow:
        """A shadow of model ``name`` from its settings (BadRequest names a bad field)."""
        self.registry.get(name, None)  # ModelNotFound for a model that is not registered
        versions = list(self.registry.models.get(name, {}))
        settings = parse_shadow(doc, versions, self.registry.defaults.get(name, ""), where)
        return Shadow(name, settings, self.registry, self._counters)

    def set(self, name: str, doc: Any, where: str = "body") -> Shadow:
        """Shadow ``name`` by ``doc`` from the next request on; counts start again."""
        shadow = self.build(name, doc, where)
        old = self.get(name)
        self.router.set_policy(name, replace(self.router.policy(name), shadow=shadow))
        if old is not None:
            old.close()
        s = shadow.settings
        log.info(
            "shadow of %s: %g%% of the requests %s answers also go to version %s", name, s.share,
            f"version {s.source}" if s.source else "the default version", s.version,
        )  # fmt: skip
        return shadow

    def clear(self, name: str) -> bool:
        """Stop shadowing ``name``; False when it had no shadow."""
        old = self.get(name)
        if old is None:
            return False
        self.router.set_policy(name, replace(self.router.policy(name), shadow=None))
        old.close()
        log.info("shadow of %s removed", name)
        return True

    # --- the management API: GET | PUT | DELETE /models/{name}/shadow ----------------------

    def inspect(self, name: str) -> dict[str, Any]:
        """``GET``: what describe shows, and the kept samples of differing pairs."""
        return self._shown(name).inspected()

    def put(self, name: str, doc: Any) -> dict[str, Any]:
        """``PUT`` with the settings as a JSON body; answers what describe shows."""
        leaving = [mv.version for mv in self.registry.versions(name) if mv.removing]
        if leaving:
            raise BadRequest(
                f"model {name} version {leaving[0]} is being unregistered: a shadow cannot be"
                " set now"
            )
        return self.set(name, doc).shown()

    def delete(self, name: str) -> dict[str, Any]:
        """``DELETE``: the shadow stops; answers its last counts."""
        shown = self._shown(name).shown()
        self.clear(name)
        return shown

    def _shown(self, name: str) -> Shadow:
        self.registry.versions(name)  # 404 for an unknown model
        shadow = self.get(name)
        if shadow is None:
            raise PathNotFound(
                f"model {name} has no shadow: set one with PUT /models/{name}/shadow"
            )
        return shadow

    def restore(self, name: str, saved: dict[str, Any]) -> Shadow:
        return self.build(name, saved, f"snapshot shadow of {name}")

    def _prune(self) -> None:
        """A version a shadow names was unregistered: the shadow ends (said in the log)."""
        for name in self.router.names():
            shadow = self.get(name)
            if shadow is None:
                continue
            versions = self.registry.models.get(name, {})
            s = shadow.settings
            gone = [v for v in (s.version, s.source) if v is not None and v not in versions]
            if gone:
                log.warning("shadow of %s removed: version %s was unregistered", name, gone[0])
                policy = replace(self.router.policy(name), shadow=None)
                self.router.set_policy(name, policy, save=False)
                shadow.close()
