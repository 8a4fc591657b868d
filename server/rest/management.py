"""The management API (8081), with TorchServe's paths and parameters. The inference port (8080)
is server/rest/inference.py, the metrics port (8082) server/metrics/server_metrics.py; all three
run on server/http/.

Errors keep TorchServe's JSON shape ``{"code", "type", "message"}``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from server.auth import Keys
from server.errors import PathNotFound
from server.http import Answer, Connection, Request, json_answer
from server.models.registry import Registry
from server.operations import (
    Outcome,
    check_model_api,
    describe,
    models_page,
    register_model,
    reload_model,
    scale_model,
    set_default,
    swap_model,
    unregister_model,
)
from server.rest import tenants as tenants_api
from server.rest.description import answer_description
from server.rest.rollouts import RolloutAPI
from server.rest.workflows import WorkflowAPI
from server.rollouts.control import no_canary_running
from server.weights import sbom

log = logging.getLogger(__name__)


async def _answer(outcome: Coroutine[Any, Any, Outcome]) -> Answer:
    """A management operation's outcome as TorchServe's answer: 200, or 202 while under way."""
    done = await outcome
    return json_answer(200 if done.done else 202, {"status": done.message})


async def _sbom(registry: Registry, name: str, version: str) -> Answer:
    """The CycloneDX SBOM of the environment the model's workers run in: its own (made when
    it was built), or the server's (one for every model on it), made now if missing."""
    model = registry.get(name, version)
    if model.env_key:  # its own environment: made as its build was, confined
        body = await asyncio.to_thread(registry.envs.sbom, model.env_key, model.label)
    else:
        target = await asyncio.to_thread(sbom.default_env_file, registry.config.run_path,
                                         model.python)  # fmt: skip
        body = await asyncio.to_thread(sbom.ensure, model.python, target, model.label)
    return 200, [["Content-Type", sbom.MEDIA_TYPE]], body


async def _json(answer: Coroutine[Any, Any, dict[str, Any]]) -> Answer:
    return json_answer(200, await answer)


# --- management ----------------------------------------------------------------------------


class ManagementAPI:
    """The router of the management port; calls that wait on workers are answered from tasks."""

    def __init__(
        self, registry: Registry, keys: Keys | None, model_api: bool,
        workflows: WorkflowAPI | None = None, rollouts: RolloutAPI | None = None,
    ) -> None:  # fmt: skip
        """``keys``: token authorization's keys (None: off), rotated by ``GET /token``.
        ``model_api``: whether registering and unregistering through the API is allowed
        (``enable_model_api``); startup models load either way. ``workflows``: the
        ``/workflows`` API (None: no such path)."""
        self.registry = registry
        self.keys = keys
        self.model_api = model_api
        self.workflows = workflows
        self.rollouts = rollouts  # /models/{name}/traffic and /canary (server/rest/rollouts.py)

    def route(self, conn: Connection, req: Request) -> None:
        if answer_description("management", conn, req):
            return
        parts, registry = req.parts, self.registry
        if parts and parts[0] == "workflows" and self.workflows is not None:
            self.workflows.manage(conn, req)
            return
        if parts == ["models"]:
            if req.allow("GET", "POST") == "GET":
                conn.answer_json(req, 200, models_page(registry, req.query))
            else:
                check_model_api(self.model_api, "registering models", registry.config.torchserve)
                conn.answer_later(req, _answer(register_model(registry, req.query)))
            return
        if tenants_api.manage(conn, req, registry):  # /tenants (server/rest/tenants.py)
            return
        if parts == ["token"]:
            req.allow("GET")
            if self.keys is None:
                raise PathNotFound(
                    "token authorization is off (disable_token_authorization): there are no"
                    " keys to rotate"
                )
            conn.answer_json(req, 200, self.keys.rotate(req.query.get("type", "")))
            return
        if parts == ["environments"]:
            if req.allow("GET", "DELETE") == "GET":
                conn.answer_later(req, self._environments())
            else:
                conn.answer_later(req, self._prune_environments())
            return
        if len(parts) == 4 and parts[0] == "models" and parts[3] == "sbom":
            req.allow("GET")  # what the model's environment holds (server/weights/sbom.py)
            conn.answer_later(req, _sbom(registry, parts[1], parts[2]))
            return
        if len(parts) == 4 and parts[0] == "models" and parts[3] == "set-default":
            req.allow("PUT")
            done = set_default(registry, parts[1], parts[2])
            conn.answer_json(req, 200, {"status": done.message})
            return
        if len(parts) == 4 and parts[0] == "models" and parts[3] == "swap":
            req.allow("PUT")  # an in-place swap (server/models/swap.py)
            if self.rollouts is not None:
                no_canary_running(self.rollouts.router, parts[1], "swapping its versions")
            conn.answer_later(req, _answer(swap_model(registry, parts[1], parts[2], req.query)))
            return
        # a hot reload of the handler's code (server/models/reload.py); GET /models/m/reload
        # still describes a version named "reload"
        if (
            parts[-1:] == ["reload"]
            and parts[:1] == ["models"]
            and (len(parts) == 4 or (len(parts) == 3 and req.method == "PUT"))
        ):
            req.allow("PUT")
            version = parts[2] if len(parts) == 4 else None
            conn.answer_later(req, _json(reload_model(registry, parts[1], version)))
            return
        if self.rollouts is not None and self.rollouts.manage(conn, req):
            return
        if len(parts) not in (2, 3) or parts[0] != "models":
            raise req.not_found()
        name, version = parts[1], (parts[2] if len(parts) == 3 else None)
        method = req.allow("GET", "PUT", "DELETE")
        if method == "GET":
            described = describe(registry, name, version)
            if self.rollouts is not None:
                described = self.rollouts.described(name, described)
            conn.answer_json(req, 200, described)
        elif method == "PUT":
            conn.answer_later(req, _answer(scale_model(registry, name, version, req.query)))
        else:
            check_model_api(self.model_api, "unregistering models", registry.config.torchserve)
            conn.answer_later(req, _answer(unregister_model(registry, name, version)))

    async def _environments(self) -> Answer:
        """The per-model environment cache: where, how big, which entries registered models
        use."""
        registry = self.registry
        entries = await asyncio.to_thread(registry.envs.entries)
        in_use = registry.envs_in_use()
        return json_answer(200, {
            "root": str(registry.envs.root),
            "totalBytes": sum(int(e["size_bytes"]) for e in entries),  # type: ignore[call-overload]
            "environments": [{**e, "inUse": e["key"] in in_use} for e in entries],
        })  # fmt: skip

    async def _prune_environments(self) -> Answer:
        """Remove every cached environment that no registered model uses."""
        registry = self.registry
        removed = await asyncio.to_thread(registry.envs.prune, registry.envs_in_use())
        return json_answer(200, {"removed": removed})
