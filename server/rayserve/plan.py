"""What each archive becomes on Ray Serve: its settings, replicas, GPUs and runtime environment.

Imports no Ray: the mapping is read from archives through the server's own code (the unpack
cache of server/store.py, the setting precedence of server/models/registry.py, the requirement
rules of server/model_envs.py), so it is the same as a single-node mserve's and can be checked
without a cluster (``mserve ray deploy --dry-run`` prints it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from archiver import __version__
from server.config import ServerConfig
from server.config.model_settings import SETTINGS, ModelSettings, shown
from server.download import is_remote
from server.errors import BadRequest, InvalidModel
from server.model_envs import find_uv, normalise_requirements, protected_constraints
from server.models.registry import RegisterRequest, effective_settings
from server.rundir import StartupModel
from server.store import resolve_url, unpack

log = logging.getLogger(__name__)

# Requests a replica holds at once beyond its batch (the server's IN_FLIGHT_REQUESTS per worker)
REPLICA_IN_FLIGHT = 8
# Serve names deployments in URLs and logs; keep ours to characters that need no quoting
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
PROTECTED = ("torch",)


@dataclass(frozen=True)
class Overrides:
    """Command-line choices that the archive cannot make: how much of a node a replica takes,
    and settings an operator changes at deploy time (``mserve ray scale``)."""

    cpus_per_replica: float = 1.0  # Ray's own default for a Serve replica
    gpus_per_replica: float | None = None  # None: 1 for a GPU model (deviceType/deviceIds), else 0
    min_workers: int | None = None
    max_workers: int | None = None
    use_uv: bool = True
    # who installs an archive's requirements: "mserve" (server/model_envs.py, in each replica, once
    # per node) or "ray" (the deployment's runtime_env); docs/ray.md, Requirements
    env_builder: str = "mserve"


@dataclass(frozen=True)
class ModelPlan:
    """One model version as a Serve deployment. ``replica`` is what each replica gets to load
    the handler (plain JSON types: Serve pickles it into its checkpoint)."""

    name: str
    version: str
    archive: str  # absolute path; every node must be able to read it (docs/ray.md)
    settings: ModelSettings
    num_cpus: float
    num_gpus: float
    runtime_env: dict[str, Any] | None
    replica: dict[str, Any]
    notes: tuple[str, ...] = field(default=())

    @property
    def label(self) -> str:
        return f"{self.name}:{self.version}"

    @property
    def deployment_name(self) -> str:
        return f"{self.name}.{self.version}"

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments of ``Deployment.options``: minWorkers/maxWorkers become a fixed
        replica count or Serve's autoscaling bounds, jobQueueSize the handle's queue bound."""
        s = self.settings
        actor: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.runtime_env:
            actor["runtime_env"] = self.runtime_env
        options: dict[str, Any] = {
            "name": self.deployment_name,
            "ray_actor_options": actor,
            "max_ongoing_requests": max(REPLICA_IN_FLIGHT, 2 * s.batch_size),
            "max_queued_requests": s.job_queue_size,
            "graceful_shutdown_timeout_s": 5,
            # a handler that fails to load fails the same way the next time: report it soon
            "max_constructor_retry_count": 3,
        }
        options.update(replica_bounds(s.min_workers, s.max_workers, s.batch_size))
        return options

    def entry(self) -> dict[str, Any]:
        """Everything the application is built from, in JSON types: what ``--dry-run`` prints,
        what the ingress keeps and ``status`` shows, and what ``scale`` redeploys."""
        s = self.settings
        return {
            "name": self.name,
            "version": self.version,
            "archive": self.archive,
            "settings": shown(s, (setting for setting in SETTINGS if setting.ray)),
            "options": self.deployment_options(),
            "replica": self.replica,
            "notes": list(self.notes),
        }


def replica_bounds(min_workers: int, max_workers: int, batch_size: int) -> dict[str, Any]:
    """minWorkers == maxWorkers: that many replicas (at least one: a model nobody can reach is
    no deployment); otherwise Serve's autoscaling between the two, starting at minWorkers."""
    if min_workers >= max_workers:
        return {"num_replicas": max(1, min_workers), "autoscaling_config": None}
    return {
        "num_replicas": None,
        "autoscaling_config": {
            "min_replicas": min_workers,
            "max_replicas": max_workers,
            "initial_replicas": max(1, min_workers),
            # a replica is busy enough to add another when a batch waits behind its batch
            "target_ongoing_requests": max(2, batch_size),
        },
    }


def scaled_options(
    options: dict[str, Any], min_workers: int, max_workers: int | None, batch_size: int
) -> dict[str, Any]:
    """Deployment options with new replica bounds (``mserve ray scale``)."""
    if min_workers < 0 or (max_workers is not None and max_workers < 0):
        raise BadRequest("--min-workers and --max-workers must be 0 or more")
    upper = max(max_workers if max_workers is not None else min_workers, min_workers)
    return {**options, **replica_bounds(min_workers, upper, batch_size)}


def plan_models(
    models: list[StartupModel], cache_dir: Path, overrides: Overrides | None = None
) -> list[ModelPlan]:
    """Unpack each archive once into ``cache_dir`` (a replica on the same node finds it there)
    and work out its deployment. Raises ``MserveError`` naming the archive that cannot be used."""
    overrides = overrides or Overrides()
    if not models:
        raise BadRequest("no models to deploy: give --models NAME=PATH (or MSERVE_RAY_MODELS)")
    cache_dir = cache_dir.expanduser().absolute()
    plans: list[ModelPlan] = []
    for model in models:
        plan = plan_model(model, cache_dir, overrides)
        if any(p.label == plan.label for p in plans):
            raise BadRequest(f"model {plan.label} is given twice ({model.url})")
        plans.append(plan)
    return plans


def plan_model(model: StartupModel, cache_dir: Path, overrides: Overrides) -> ModelPlan:
    if is_remote(model.url):
        raise BadRequest(
            f"{model.url}: give a path that every Ray node can read (a shared file system), not"
            " a URL: replicas unpack the archive from that path (docs/ray.md, Big weights)"
        )
    path = resolve_url(model.url, None, (), trusted=True)
    unpacked = unpack(path, model.url, cache_dir)
    manifest = unpacked.manifest
    name = model.name or manifest.model.model_name
    version = manifest.model.model_version
    for what, value in (("model name", name), ("model version", version)):
        if not _NAME_OK.match(value):
            raise BadRequest(
                f"{model.url}: {what} {value!r} cannot name a Serve deployment (letters, digits,"
                " '_', '.', '-')"
            )
    request = RegisterRequest(
        url=model.url,
        model_name=name,
        initial_workers=overrides.min_workers,
        max_workers=overrides.max_workers,
        trusted=True,
    )
    settings = effective_settings(request, unpacked.model_config, ServerConfig())
    if overrides.min_workers is not None and overrides.max_workers is None:
        settings = replace(settings, max_workers=max(settings.max_workers, settings.min_workers))
    notes: list[str] = []
    num_gpus = _gpus(name, version, settings, overrides, notes)
    runtime_env = None
    env = None
    wheelhouse = (manifest.extra.get("mserve") or {}).get("wheelhouse")
    if overrides.env_builder not in ("mserve", "ray"):
        raise BadRequest(f"--env-builder {overrides.env_builder!r}: say mserve or ray")
    if manifest.model.requirements_file and overrides.env_builder == "ray":
        runtime_env = runtime_env_for(
            unpacked.model_dir, manifest.model.requirements_file, wheelhouse,
            unpacked.model_config, overrides.use_uv, notes,
        )  # fmt: skip
    elif manifest.model.requirements_file:
        env = replica_env(unpacked.model_dir, manifest.model.requirements_file, wheelhouse,
                          unpacked.model_config, notes)  # fmt: skip
    manifest_json = manifest.to_json()
    replica = {
        "model_name": name,
        "model_version": version,
        "archive": str(path),
        "sha256": unpacked.sha256,
        "cache_dir": str(cache_dir),
        "handler": manifest.model.handler,
        "handler_style": (manifest_json.get("mserve") or {}).get("handlerStyle"),
        "manifest": manifest_json,
        "batch_size": settings.batch_size,
        "max_batch_delay_ms": settings.max_batch_delay_ms,
        "response_timeout_s": settings.response_timeout_s,
        "model_yaml_config": unpacked.model_config,
        "server_version": __version__,
        "use_gpu": num_gpus > 0,
        "max_response_bytes": ServerConfig().max_response_size_bytes,
        "env": env,
    }
    return ModelPlan(
        name=name,
        version=version,
        archive=str(path),
        settings=settings,
        num_cpus=overrides.cpus_per_replica,
        num_gpus=num_gpus,
        runtime_env=runtime_env,
        replica=replica,
        notes=tuple(notes),
    )


def _gpus(
    name: str, version: str, settings: ModelSettings, overrides: Overrides, notes: list[str]
) -> float:
    """GPU pinning becomes a GPU request per replica; Ray picks the device and sets
    ``CUDA_VISIBLE_DEVICES``, so ``deviceIds`` cannot choose which one."""
    if settings.device_type not in (None, "gpu") and settings.device_ids:
        raise InvalidModel(
            f"model {name}:{version} has deviceType {settings.device_type} and deviceIds"
            f" {list(settings.device_ids)}: only a gpu model can be pinned to GPUs; remove one"
            " of the two"
        )
    if settings.device_ids:
        notes.append(
            f"deviceIds {list(settings.device_ids)} not honoured: Ray assigns each replica its GPU"
        )
    if overrides.gpus_per_replica is not None:
        return overrides.gpus_per_replica
    if settings.device_type == "gpu" or settings.device_ids:
        return 1.0
    return 0.0


def _requirements(model_dir: Path, requirements_file: str) -> str:
    try:
        return (model_dir / requirements_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidModel(f"cannot read {requirements_file} of the archive: {exc}") from exc


def replica_env(
    model_dir: Path,
    requirements_file: str,
    wheelhouse: str | None,
    model_config: dict[str, Any],
    notes: list[str],
) -> dict[str, Any] | None:
    """What a replica asks mserve's environment cache for (server/model_envs.py, built on its node
    under the cache's file lock, so once per node): the requirements, and the wheelhouse inside
    the unpacked archive, which every node has."""
    text = _requirements(model_dir, requirements_file)
    if not normalise_requirements(text):
        return None
    if model_config.get("isolatedEnv"):
        notes.append("isolatedEnv not honoured: a replica's packages come first on Ray")
    return {"requirements": text, "wheelhouse": wheelhouse}


def runtime_env_for(
    model_dir: Path,
    requirements_file: str,
    wheelhouse: str | None,
    model_config: dict[str, Any],
    use_uv: bool,
    notes: list[str],
) -> dict[str, Any] | None:
    """The archive's requirements as a Ray runtime environment, by mserve's rules where Ray
    lets us: comments and order do not count, an archive's wheelhouse installs offline, and a
    pin that would replace the protected base packages (torch and what it needs) is refused by
    constraints. Ray builds it once per node and layers it over the Ray worker's packages."""
    packages = normalise_requirements(_requirements(model_dir, requirements_file)).splitlines()
    if not packages:
        return None
    if model_config.get("isolatedEnv"):
        notes.append("isolatedEnv not honoured: Ray layers a runtime_env over its own packages")
    options: list[str] = []
    if wheelhouse:
        options += ["--no-index", "--find-links", str(model_dir / wheelhouse)]
    pins = protected_constraints(PROTECTED)
    if pins:
        body = "\n".join(pins) + "\n"
        digest = hashlib.sha256(body.encode()).hexdigest()[:16]
        constraints = model_dir.parent / f"constraints-{digest}.txt"
        if not constraints.is_file():
            tmp = constraints.with_name(f".{constraints.name}.{os.getpid()}")
            tmp.write_text(body)
            os.replace(tmp, constraints)
        options += ["-c", str(constraints)]
    if use_uv and find_uv() is not None:
        # Ray's uv plugin runs `uv pip install` into a virtualenv of its own
        return {"uv": {"packages": packages, "uv_pip_install_options": options}}
    return {"pip": {"packages": packages, "pip_install_options": options, "pip_check": False}}
