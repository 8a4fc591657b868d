"""Build, deploy, describe, scale and delete the Serve application of a set of archives.

For people composing Ray apps themselves, ``app`` is a Serve application builder:

    serve run server.rayserve.app:app models=mlp=/shared/mlp.mar,echo=/shared/echo.mar

or, in a Serve config file, ``import_path: server.rayserve.app:app`` with ``args: {models:
...}``; without ``models`` it reads ``MSERVE_RAY_MODELS`` (docs/ray.md).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve import Application, Deployment

from archiver import __version__
from server.errors import BadRequest, InvalidModel, ModelNotFound, ModelVersionNotFound
from server.model_envs import runtime_digest
from server.rayserve.ingress import Ingress
from server.rayserve.plan import ModelPlan, Overrides, plan_models, scaled_options
from server.rayserve.replica import ModelReplica
from server.rundir import StartupModel

APP_NAME = "mserve"
INGRESS = "ingress"
INGRESS_IN_FLIGHT = 256
# the server's own unpack cache: an archive both serve is unpacked once
DEFAULT_CACHE = "~/.mserve/unpacked"


class DeployFailed(InvalidModel):
    """Serve could not start a deployment; the message carries each failed one's error."""


def build_app(plans: list[ModelPlan], ingress_cpus: float = 0.0) -> Application:
    """The application: one deployment per model version, and the ingress bound to them."""
    return build_from_entries([plan.entry() for plan in plans], ingress_cpus)


def build_from_entries(entries: list[dict[str, Any]], ingress_cpus: float = 0.0) -> Application:
    """The application from plan entries (``ModelPlan.entry``), which the ingress keeps, so
    that ``scale`` redeploys what is running without reading the archives again."""
    routes: dict[str, dict[str, Any]] = {}
    models: dict[str, Any] = {}
    for entry in entries:
        name, version = entry["name"], entry["version"]
        deployment = _versioned(
            serve.deployment(ModelReplica).options(**entry["options"]),
            [entry["replica"], entry["options"]["ray_actor_options"]],
        )
        routes.setdefault(name, {})[version] = deployment.bind(entry["replica"])
        model = models.setdefault(name, {"default": version, "versions": {}})
        model["versions"][version] = entry
    ingress = serve.deployment(Ingress).options(
        name=INGRESS,
        num_replicas=1,
        ray_actor_options={"num_cpus": ingress_cpus},
        # it only waits on the models' replicas: Serve's default of 5 at once queued clients
        # at the proxy while the models idled (the models' own queues stay bounded)
        max_ongoing_requests=INGRESS_IN_FLIGHT,
    )
    return _versioned(ingress, [models, ingress_cpus]).bind(routes, models)


def _versioned(deployment: Deployment, identity: list[Any]) -> Deployment:
    """The deployment with a version that changes only with what its replicas are made of
    (the archive, the handler, the runtime environment, resources, mserve's own code), so
    that a redeploy that changes only the replica count scales in place instead of replacing
    every replica (``serve.run`` gives each deployment a random version otherwise)."""
    digest = hashlib.sha256(
        json.dumps([__version__, runtime_digest(), *identity], sort_keys=True).encode()
    ).hexdigest()[:16]
    return deployment.options(version=digest, _internal=True)


def parse_model_list(value: str | list[str] | None) -> list[StartupModel]:
    """``NAME=PATH`` items, comma-separated or a list, as ``mserve --models`` takes them."""
    from server.rundir import parse_models

    if not value:
        return []
    return parse_models([value] if isinstance(value, str) else list(value))


def app(args: Mapping[str, Any]) -> Application:
    """Serve application builder (``serve run``, a config file's ``import_path``). Keys:
    ``models``, ``cache_dir``, ``cpus_per_replica``, ``gpus_per_replica``, ``env_builder``
    (``mserve`` or ``ray``); each falls back to
    ``MSERVE_RAY_<KEY>`` in the environment."""

    def arg(key: str) -> Any:
        value = args.get(key)
        return value if value not in (None, "") else os.environ.get(f"MSERVE_RAY_{key.upper()}")

    models = parse_model_list(arg("models"))
    overrides = Overrides(
        cpus_per_replica=float(arg("cpus_per_replica") or 1.0),
        gpus_per_replica=float(arg("gpus_per_replica")) if arg("gpus_per_replica") else None,
        env_builder=arg("env_builder") or "mserve",
    )
    cache = Path(arg("cache_dir") or DEFAULT_CACHE).expanduser()
    return build_app(plan_models(models, cache, overrides))


# --- a cluster --------------------------------------------------------------------------------


def connect(address: str | None) -> None:
    """Join a running cluster as a driver (quietly: replica logs stay in Ray's log files).
    Never starts one: ``ray.init()`` without an address would start a cluster that ends with
    this command, taking the deployment with it."""
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or "auto"
        ray.init(address=address, log_to_driver=False, configure_logging=False)


def deploy(
    plans: list[ModelPlan],
    *,
    app_name: str = APP_NAME,
    http_host: str = "127.0.0.1",
    http_port: int = 8000,
    ingress_cpus: float = 0.0,
) -> None:
    """Deploy (or update in place) and wait until every deployment is running. Serve's HTTP
    proxy is started on ``http_host:http_port`` if Serve is not running yet."""
    serve.start(http_options={"host": http_host, "port": http_port})
    try:
        serve.run(build_app(plans, ingress_cpus), name=app_name, route_prefix="/")
    except RuntimeError as exc:  # Serve names the deployment; its status says why
        raise DeployFailed(f"{exc}{_failures(app_name)}") from exc


def _failures(app_name: str) -> str:
    """What Serve's status says about each deployment that is not healthy: the replica's own
    error (a handler that failed to load, an environment that failed to build)."""
    application = serve.status().applications.get(app_name)
    if application is None:
        return ""
    lines = [
        f"\n{name}: {d.message}"
        for name, d in application.deployments.items()
        if str(d.status.value) not in ("HEALTHY", "UPDATING") and d.message
    ]
    return "".join(lines)


def describe(app_name: str = APP_NAME) -> dict[str, Any]:
    """Each model's deployment: Serve's status, replicas by state, and the mapped settings."""
    status = serve.status()
    application = status.applications.get(app_name)
    if application is None:
        raise BadRequest(f"no Serve application {app_name!r} on this cluster")
    models = _running_models(app_name)
    out: dict[str, Any] = {
        "application": app_name,
        "status": str(application.status.value),
        "message": application.message,
        "models": [],
    }
    for name, model in models.items():
        for version, entry in model["versions"].items():
            deployment = application.deployments.get(entry["options"]["name"])
            replicas = dict(deployment.replica_states) if deployment else {}
            out["models"].append(
                {
                    "modelName": name,
                    "modelVersion": version,
                    "default": version == model["default"],
                    "deployment": entry["options"]["name"],
                    "status": str(deployment.status.value) if deployment else "MISSING",
                    "message": deployment.message if deployment else "",
                    "replicas": {str(getattr(k, "value", k)): v for k, v in replicas.items()},
                    "settings": entry["settings"],
                    "options": entry["options"],
                    "notes": entry["notes"],
                }
            )
    return out


def _running_models(app_name: str) -> dict[str, Any]:
    """The ingress's model table: what was deployed, as deployed."""
    handle = serve.get_app_handle(app_name)
    return handle.mapping.remote().result(timeout_s=60)


def scale(
    model: str,
    version: str | None,
    min_workers: int,
    max_workers: int | None = None,
    app_name: str = APP_NAME,
    ingress_cpus: float = 0.0,
) -> dict[str, Any]:
    """Change a model version's replica bounds (the management API's ``min_worker`` and
    ``max_worker``) by redeploying the running application with new options; Serve replaces
    only what changed. Returns the entry as deployed."""
    models = _running_models(app_name)
    if model not in models:
        raise ModelNotFound(f"Model not found: {model}")
    key = version or models[model]["default"]
    if key not in models[model]["versions"]:
        raise ModelVersionNotFound(f"Model version {key} does not exist for model {model}")
    entries = [e for m in models.values() for e in m["versions"].values()]
    target = models[model]["versions"][key]
    target["options"] = scaled_options(
        target["options"], min_workers, max_workers, target["settings"]["batchSize"]
    )
    target["settings"] = {**target["settings"], "minWorkers": min_workers,
                          "maxWorkers": max(max_workers or min_workers, min_workers)}  # fmt: skip
    serve.run(build_from_entries(entries, ingress_cpus), name=app_name, route_prefix="/")
    return target


def delete(app_name: str = APP_NAME) -> None:
    serve.delete(app_name)
