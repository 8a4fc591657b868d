"""The operations on a model's traffic that the REST and gRPC management APIs share (docs/
rollouts.md): read, set and clear the split; start a canary, pause, resume, promote, abort and
forget it. Each checks the model first: registered (404), none of its versions being
unregistered (400); the parsers of server/rollouts/policy.py check the rest, naming the field.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from server.errors import BadRequest, PathNotFound
from server.rollouts.policy import Policy, parse_canary, parse_policy
from server.rollouts.router import Router

CANARY_ACTIONS = ("pause", "resume", "promote", "abort")


def traffic(router: Router, name: str) -> dict[str, Any]:
    """``GET /models/{name}/traffic``: the split in force and what each version served."""
    router.registry.versions(name)  # 404 for an unknown model
    return router.describe(name) or {
        "weights": {},
        "split": {router.registry.defaults[name]: 100.0},
        "sticky": None,
        "served": {},
        "canary": None,
        "shadow": None,
    }


def set_traffic(router: Router, name: str, doc: Any) -> dict[str, Any]:
    """``PUT /models/{name}/traffic``: a new split and/or sticky key (the shadow stays)."""
    versions = _versions(router, name, "a traffic split")
    policy = parse_policy(doc, versions)
    router.set_policy(name, replace(policy, shadow=router.policy(name).shadow))
    return traffic(router, name)


def clear_traffic(router: Router, name: str) -> dict[str, Any]:
    """``DELETE /models/{name}/traffic``: the default version takes every request again (a
    running canary and the shadow stay)."""
    router.registry.versions(name)
    router.set_policy(name, Policy(shadow=router.policy(name).shadow))
    return traffic(router, name)


def start_canary(router: Router, name: str, doc: Any) -> dict[str, Any]:
    """``POST /models/{name}/canary``: roll a version out over the baseline (the default)."""
    versions = _versions(router, name, "a canary")
    swap = router.registry.swaps.running(name)  # it moves the same traffic (models/swap.py)
    if swap is not None:
        raise BadRequest(
            f"model {name}: a swap from {swap.source.version} to {swap.target.version} is"
            f" running ({swap.step}); start the canary once it has ended"
        )
    plan = parse_canary(doc, versions, router.registry.defaults[name])
    router.start_canary(name, plan)
    return canary_state(router, name)


def no_canary_running(router: Router, name: str, what: str) -> None:
    """An in-place swap (server/models/swap.py) moves the traffic a canary moves: one at a
    time. ``what``: what is refused, for the message."""
    canary = router.canary(name)
    if canary is not None and canary.active:
        raise BadRequest(
            f"model {name}: a canary of version {canary.plan.version} is running"
            f" ({canary.state}); promote or abort it before {what}"
        )


def canary_state(router: Router, name: str) -> dict[str, Any]:
    """``GET /models/{name}/canary``."""
    router.registry.versions(name)
    canary = router.canary(name)
    if canary is None:
        raise PathNotFound(f"model {name} has no canary: start one with POST /models/{name}/canary")
    return canary.shown()


def canary_action(router: Router, name: str, action: str) -> dict[str, Any]:
    """``PUT /models/{name}/canary/{pause|resume|promote|abort}``."""
    if action not in CANARY_ACTIONS:
        raise PathNotFound(
            f"no canary action {action!r}: expected one of {', '.join(CANARY_ACTIONS)}"
        )
    canary_state(router, name)  # 404s
    canary = router.canary(name)
    assert canary is not None
    getattr(canary, action)()
    router.registry.changed()
    return canary.shown()


def forget_canary(router: Router, name: str) -> dict[str, Any]:
    """``DELETE /models/{name}/canary``: a running canary is aborted, then forgotten."""
    shown = canary_state(router, name)
    canary = router.canary(name)
    if canary is not None and canary.active:
        canary.abort()
        shown = canary.shown()
    router.clear_canary(name)
    return shown


def _versions(router: Router, name: str, what: str) -> list[str]:
    """The model's registered versions; refused while one is being unregistered."""
    models = router.registry.versions(name)
    leaving = [mv.version for mv in models if mv.removing]
    if leaving:
        raise BadRequest(
            f"model {name} version {leaving[0]} is being unregistered: {what} cannot be set now"
        )
    return [mv.version for mv in models]
