"""Which version of a model answers a request: every inference frontend asks
:meth:`Router.pick` instead of ``registry.get`` (REST server/rest/inference.py, the OpenAI API
server/openai/api.py, gRPC server/rpc/inference.py and server/rpc/oip.py), and calls
:meth:`Router.after_enqueue` right after it queued the request on the version picked.

The contract other modules rely on (the shadow, server/rollouts/shadow.py, in particular):

- A model name with no policy costs one dict lookup in :meth:`pick` and one in
  :meth:`after_enqueue`; nothing else changes for it.
- :meth:`pick` returns the version a request gets: the one it names, else the split's draw
  (sticky: the same key gets the same version), else the default. It raises what
  ``registry.get`` raises (ModelNotFound, ModelVersionNotFound) and nothing else.
- :meth:`after_enqueue` is called once per request that was queued (not for one refused
  before, 429/503), on the event loop, with the version picked, the request item as queued and
  its job (``job.future`` gets the answer). It counts the version served, lets a running canary
  watch the answer (a done callback on ``job.future``), then calls ``policy.shadow.send(model,
  item, job)`` when the model's policy has a shadow. ``send`` must neither block nor raise
  (an exception is logged and dropped: the client's request is never failed by it), and must
  not touch ``job`` beyond adding done callbacks to ``job.future``.
- :meth:`policy` and :meth:`set_policy` read and replace a name's :class:`Policy` (frozen;
  change one with :func:`dataclasses.replace`, e.g. ``replace(router.policy(name),
  shadow=s)``); :meth:`set_policy` checks nothing (the parsers of server/rollouts/policy.py
  did), saves the snapshot and takes effect for the next request. A policy that is
  :attr:`Policy.empty` is removed.
- :meth:`describe` is the ``traffic`` section of ``GET /models/{name}``; it includes
  ``policy.shadow.shown()`` under ``shadow``. The snapshot stores ``to_json()`` of the policy
  and of the shadow (``shadow.to_json()``), and :meth:`restore` gives the shadow's back to the
  loader registered with :meth:`on_restore_shadow`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from mserve_worker.protocol import RequestItem
from server.errors import BadRequest
from server.metrics.server_metrics import Metrics
from server.models.batching import Job
from server.models.registry import Registry
from server.models.version import ModelVersion
from server.rollouts.canary import Canary
from server.rollouts.policy import (
    CanaryPlan,
    Policy,
    Sticky,
    parse_canary,
    parse_policy,
    parse_sticky,
)
from server.rollouts.route import Route, sticky_key
from server.rollouts.shadow_settings import ShadowControl

log = logging.getLogger(__name__)


class Router:
    """The traffic policies of the registered model names (one :class:`Route` each)."""

    def __init__(self, registry: Registry, metrics: Metrics | None = None) -> None:
        self.registry = registry
        self.metrics = metrics
        self._routes: dict[str, Route] = {}
        self._shadow_loader: Callable[[str, dict[str, Any]], Any] | None = None
        # server/rollouts/shadow_control.py's Shadows, which sets itself here (REST, gRPC)
        self.shadows: ShadowControl | None = None
        # versions seen registered: a new one whose model config has ``rollout:`` starts it
        self._known: set[tuple[str, str]] = set()
        registry.on_change("traffic policies", self._changed)

    # --- the request path ------------------------------------------------------------------

    def pick(
        self, name: str, version: str | None, item: RequestItem | None = None,
        meta: dict[str, str] | None = None,
    ) -> ModelVersion:  # fmt: skip
        """The version that answers a request of ``name`` (``version``: the one it named).
        ``item`` / ``meta`` (lower-cased call metadata, gRPC) carry a sticky key."""
        swaps = self.registry.swaps
        if version is None and swaps.routing and (swapping := swaps.pick(name)) is not None:
            return swapping  # an in-place swap runs: A or B, by ready workers (models/swap.py)
        route = self._routes.get(name)
        if route is None or version is not None or not route.versions:
            return self.registry.get(name, version)
        key = sticky_key(route.sticky, item, meta) if route.sticky is not None else None
        chosen = route.by_key(key) if key is not None else route.draw()
        model = self.registry.models.get(name, {}).get(chosen)
        return model if model is not None else self.registry.get(name, None)

    def after_enqueue(self, model: ModelVersion, item: RequestItem, job: Job) -> None:
        route = self._routes.get(model.name)
        if route is None:
            return
        served = route.served
        served[model.version] = served.get(model.version, 0) + 1
        if route.canary is not None:
            route.canary.watch(model.version, job)
        shadow = route.policy.shadow
        if shadow is not None:
            try:
                shadow.send(model, item, job)
            except Exception:  # a plug-in's bug must not fail the client's request
                log.exception("the shadow of %s failed to take a request", model.label)

    # --- policies ----------------------------------------------------------------------------

    def policy(self, name: str) -> Policy:
        route = self._routes.get(name)
        return route.policy if route is not None else Policy()

    def route(self, name: str) -> Route | None:
        return self._routes.get(name)

    def set_policy(self, name: str, policy: Policy, save: bool = True) -> None:
        """Serve ``name`` by ``policy`` from the next request on (a running canary keeps its
        own weights until it ends)."""
        route = self._routes.get(name)
        if route is None:
            if policy.empty:
                return
            route = self._routes[name] = Route(policy)
        else:
            route.policy, route.sticky = policy, policy.sticky
            if route.canary is None:
                route.split(policy.weights)
            if policy.empty and route.canary is None:
                del self._routes[name]
        log.info("traffic of %s: %s", name, _said(route.current(), policy.sticky))
        if save:
            self.registry.changed()

    def canary(self, name: str) -> Canary | None:
        route = self._routes.get(name)
        return route.canary if route is not None else None

    def start_canary(self, name: str, plan: CanaryPlan, save: bool = True) -> Canary:
        """Begin rolling ``plan.version`` out over ``plan.baseline`` (checked by the parser)."""
        route = self._routes.get(name)
        if route is None:
            route = self._routes[name] = Route(Policy())
        if route.canary is not None and route.canary.active:
            raise BadRequest(
                f"model {name} already has a canary of version {route.canary.plan.version}"
                f" running ({route.canary.state}); abort or promote it first"
            )
        if route.canary is not None:
            route.canary.stop()
        route.served = {}
        canary = Canary(name, plan, self._canary_split, self._canary_ended, self._canary_saved,
                        self.registry, self.metrics)  # fmt: skip
        route.canary = canary
        canary.start()
        if save:
            self.registry.changed()
        return canary

    def _canary_split(self, name: str, weights: tuple[tuple[str, float], ...]) -> None:
        route = self._routes.get(name)
        if route is not None:
            route.split(weights)

    def _canary_ended(self, name: str, promoted: bool) -> None:
        """The canary was promoted (its version is the default now) or rolled back: the split
        it replaced serves again, the canary's version out of it when it was rolled back."""
        route = self._routes.get(name)
        if route is None or route.canary is None:
            return
        plan = route.canary.plan
        weights = route.policy.weights
        if weights and not promoted:
            weights = tuple((v, w) for v, w in weights if v != plan.version)
            weights = _normalised(weights) if weights else ((plan.baseline, 100.0),)
            route.policy = replace(route.policy, weights=weights)
        elif weights and promoted:
            route.policy = replace(route.policy, weights=())
        if route.policy.weights:
            route.split(route.policy.weights)
        else:  # the default version takes every request (the canary's, once promoted)
            route.split(((plan.version if promoted else plan.baseline, 100.0),))
        self.registry.changed()

    def _canary_saved(self) -> None:
        self.registry.changed()

    def clear_canary(self, name: str) -> None:
        """Forget an ended canary (its outcome stays in describe until then)."""
        route = self._routes.get(name)
        if route is None or route.canary is None:
            return
        route.canary.stop()
        route.canary = None
        route.split(route.policy.weights)
        if route.policy.empty:
            del self._routes[name]
        self.registry.changed()

    def _changed(self) -> None:
        self._prune()
        self._roll_out_new()

    def _roll_out_new(self) -> None:
        """A version registered through the API whose model config has a ``rollout:`` section
        (docs/rollouts.md) is rolled out as that section says: a canary over the default
        version, and/or a sticky key. Startup and snapshot models are not (the snapshot has
        their state)."""
        registered = {(mv.name, mv.version): mv for mv in self.registry.all()}
        self._known &= set(registered)
        for key, mv in registered.items():
            if key in self._known:
                continue
            self._known.add(key)
            section = mv.model_yaml_config.get("rollout")
            if section is None or mv.loaded_at_startup:
                continue
            try:
                self._roll_out(mv.name, mv.version, section)
            except BadRequest as exc:
                log.error("the rollout: section of %s was not applied: %s", mv.label, exc.message)

    def _roll_out(self, name: str, version: str, section: Any) -> None:
        where = f"model config of {name}:{version}, rollout"
        if not isinstance(section, dict) or not set(section) <= {"canary", "sticky", "shadow"}:
            raise BadRequest(f"{where}: expected an object with 'canary', 'sticky' and/or 'shadow'")
        versions = list(self.registry.models.get(name, {}))
        if section.get("sticky") is not None:
            sticky = parse_sticky(section["sticky"], f"{where}.sticky")
            self.set_policy(name, replace(self.policy(name), sticky=sticky))
        shadow = section.get("shadow")  # this version shadows the default's requests
        if shadow is not None and self.shadows is not None:
            if self.registry.defaults.get(name, version) == version:
                log.info("%s:%s is the default version: its rollout.shadow has nothing to"
                         " shadow", name, version)  # fmt: skip
            else:
                doc = {**shadow, "version": version} if isinstance(shadow, dict) else shadow
                self.shadows.set(name, doc, f"{where}.shadow")
        canary = section.get("canary")
        if canary is not None:
            default = self.registry.defaults.get(name, version)
            if default == version:
                log.info("%s:%s is the default version: its rollout.canary has nothing to"
                         " roll out over", name, version)  # fmt: skip
                return
            doc = {**canary, "version": version} if isinstance(canary, dict) else canary
            self.start_canary(name, parse_canary(doc, versions, default, f"{where}.canary"))

    def _prune(self) -> None:
        """A registered version went away: out of the splits; a canary that named it ends."""
        for name, route in list(self._routes.items()):
            versions = self.registry.models.get(name)
            if not versions:
                if route.canary is not None:
                    route.canary.stop()
                del self._routes[name]
                log.info("traffic policy of %s removed: the model is unregistered", name)
                continue
            canary = route.canary
            if canary is not None and canary.active:
                gone = [v for v in (canary.plan.version, canary.plan.baseline) if v not in versions]
                if gone:
                    canary.end_outside(f"version {gone[0]} was unregistered")
            if any(v not in versions for v, _ in route.policy.weights):
                kept = tuple((v, w) for v, w in route.policy.weights if v in versions)
                route.policy = replace(route.policy, weights=_normalised(kept) if kept else ())
                log.info("traffic of %s: %s (a version was unregistered)", name,
                         _said(route.policy.weights, route.policy.sticky))  # fmt: skip
                if canary is None or not canary.active:
                    route.split(route.policy.weights)
                    if route.policy.empty and canary is None:
                        del self._routes[name]

    # --- describe, snapshot ------------------------------------------------------------------

    def describe(self, name: str) -> dict[str, Any] | None:
        """The ``traffic`` section of describe: the split in force, each version's share of
        the requests actually served since it was set, stickiness, the canary, the shadow."""
        route = self._routes.get(name)
        if route is None:
            return None
        total = sum(route.served.values())
        shadow = route.policy.shadow
        return {
            "weights": dict(route.policy.weights),
            "split": dict(route.current()),
            "sticky": route.sticky.to_json() if route.sticky is not None else None,
            "served": {
                v: {"requests": n, "share": round(n / total, 4) if total else 0.0}
                for v, n in sorted(route.served.items())
            },
            "canary": route.canary.shown() if route.canary is not None else None,
            "shadow": shadow.shown() if shadow is not None else None,
        }

    def names(self) -> list[str]:
        return sorted(self._routes)

    def to_json(self) -> dict[str, Any]:
        """What the snapshot keeps, per model name."""
        saved: dict[str, Any] = {}
        for name, route in self._routes.items():
            entry: dict[str, Any] = route.policy.to_json()
            if route.canary is not None:
                entry["canary"] = route.canary.to_json()
            if route.policy.shadow is not None:
                entry["shadow"] = route.policy.shadow.to_json()
            saved[name] = entry
        return saved

    def on_restore_shadow(self, loader: Callable[[str, dict[str, Any]], Any]) -> None:
        """server/rollouts/shadow_control.py: ``loader(name, saved)`` makes a policy's shadow
        back from what its ``to_json()`` saved (raising BadRequest when it no longer fits)."""
        self._shadow_loader = loader

    def restore(self, saved: dict[str, Any]) -> None:
        """Put the snapshot's policies back, once its models are registered; one that no longer
        fits (a version failed to restore) is logged and dropped."""
        for name, entry in saved.items():
            versions = list(self.registry.models.get(name, {}))
            try:
                if not versions:
                    raise BadRequest(f"model {name} is not registered")
                policy = parse_policy(
                    {"weights": entry.get("weights") or None, "sticky": entry.get("sticky")},
                    versions, f"snapshot traffic of {name}",
                )  # fmt: skip
                if entry.get("shadow") is not None and self._shadow_loader is not None:
                    policy = replace(policy, shadow=self._shadow_loader(name, entry["shadow"]))
                self.set_policy(name, policy, save=False)
                if entry.get("canary") is not None:
                    canary = Canary.restored(
                        name, entry["canary"], versions, self.registry.defaults.get(name, ""),
                        self._canary_split, self._canary_ended, self._canary_saved,
                        self.registry, self.metrics,
                    )  # fmt: skip
                    route = self._routes.get(name) or Route(policy)
                    self._routes[name] = route
                    route.canary = canary
                    canary.resume_after_restart()
            except BadRequest as exc:
                log.error("traffic policy of %s not restored: %s", name, exc.message)

    def close(self) -> None:
        for route in self._routes.values():
            if route.canary is not None:
                route.canary.stop()


def _normalised(weights: tuple[tuple[str, float], ...]) -> tuple[tuple[str, float], ...]:
    total = sum(w for _, w in weights)
    if total <= 0:
        return tuple((v, 100.0 / len(weights)) for v, _ in weights)
    return tuple((v, w * 100.0 / total) for v, w in weights)


def _said(weights: tuple[tuple[str, float], ...], sticky: Sticky | None) -> str:
    split = ", ".join(f"{v} {w:g}%" for v, w in weights) or "the default version"
    how = f"; sticky by {sticky.to_json()}" if sticky is not None else ""
    return split + how
